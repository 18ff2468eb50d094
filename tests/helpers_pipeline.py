"""What the pipeline test modules (tests/test_pipeline*.py) share beyond tests/helpers.py's pipeline section: a
TinyLM split into blocks with its batches, the 8-block MLP the chunked schedules split, and the construction-error
runner. Test modules import these from here, never from one another.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from examples.lm import TinyLM, as_sequential
from gpudist import PipelineParallelModel, ShardingConfiguration

from .helpers import _mlp

# --------------------------------------------------------------- TinyLM with a tied embedding (tests/test_pipeline.py)


def lm() -> nn.Sequential:
    return as_sequential(TinyLM(32, 16, n_layers=3, n_heads=2, seq_len=8, seed=0))


def lm_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 32, (8, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


# -------------------------------------------------------------- chunked schedules (tests/test_pipeline_interleaved.py)

_DEEP = _mlp(8)


def deep() -> nn.Sequential:
    """8 blocks: 4 chunks of 2 at p=2, 8 chunks of 1 at p=4 (a copy: in-memory ranks are threads)."""
    return copy.deepcopy(_DEEP)


def construction_errors(comm, settings: list[dict]) -> list[str]:
    """The error text of wrapping :func:`deep` with each of ``settings`` (each must be refused)."""
    config = ShardingConfiguration(comm)
    errors = []
    for kwargs in settings:
        with pytest.raises(ValueError) as info:
            PipelineParallelModel(deep(), config, **kwargs)
        errors.append(str(info.value))
    return errors
