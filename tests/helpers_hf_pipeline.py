"""What the tests of Hugging Face decoders in a pipeline (tests/test_hf_pipeline.py, and the Llama cases of
tests/test_pipeline_interleaved.py and tests/test_pipeline_zero_bubble.py) share: the step count, the (left-padded)
batches, the state-dict flattening, and a tied 4-layer Llama with its single-process reference and check. Test
modules import these from here, never from one another.

Importing this module does not import ``transformers``: the models are built by tests/hf_models.py on first use.
"""

from __future__ import annotations

from pathlib import Path

import torch

import gpudist
from gpudist.checkpoint import read_manifest

from .hf_models import tiny_llama, token_batch
from .tolerances import assert_matches_reference, reference_pair

STEPS, BATCH = 3, 8
PADS = [1, 6, 2, 5, 3, 4, 6, 1]
"""Left padding per sequence (right padding would go unseen: causal attention never looks past a token): every
pair of sequences (one micro-batch of 2) counts 25 labels, so the mean of the micro-batches' mean losses is the
batch's mean (the contract of train_step with a per-token mean loss)."""


def batch(step: int, padded: bool = False, rank: int = 0, world: int = 1) -> tuple[dict, torch.Tensor]:
    """Inputs and labels of ``step`` (this replica's slice): token ids, with ``padded`` a left-padded batch whose
    padding is masked in attention and ignored (-100) in the labels."""
    ids = token_batch(step, size=BATCH)
    inputs, labels = {"input_ids": ids}, ids.clone()
    if padded:
        mask = torch.ones_like(ids)
        for row, pad in enumerate(PADS):
            if pad:
                mask[row, :pad] = 0
        inputs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
        labels = labels.masked_fill(mask == 0, -100)
    per = BATCH // world
    return {k: v[rank * per : (rank + 1) * per] for k, v in inputs.items()}, labels[rank * per : (rank + 1) * per]


def flat(state: dict[str, torch.Tensor]) -> torch.Tensor:
    """Every floating entry of a state dict, in name order, as one float64 vector."""
    return torch.cat([state[k].detach().double().reshape(-1) for k in sorted(state) if state[k].is_floating_point()])


# ------------------------------------------- a tied Llama under chunked schedules (tests/test_pipeline_interleaved.py)


def llama4(dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    return tiny_llama(tied=True, layers=4, dtype=dtype)


def llama_reference(dtype=torch.float32):
    net = llama4(dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for step in range(STEPS):
        inputs, labels = batch(step, padded=True)
        loss = net(**inputs, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return flat(net.state_dict()), losses


def check_llama_pipeline(results: list[tuple], saved: Path) -> None:
    """Every rank's ``(full state, losses, ...)`` equals one process's training of :func:`llama4`, and the checkpoint
    at ``saved`` lists the model's own parameter names and loads into the plain model."""
    (want32, losses32), (want64, losses64) = reference_pair(llama_reference)
    for state, losses, *_ in results:
        assert sorted(state) == sorted(llama4().state_dict())
        assert_matches_reference(flat(state), want32, want64, what="parameters")
        assert_matches_reference(losses, losses32, losses64, what="losses")
    names = sorted(row["name"] for row in read_manifest(saved)["parameters"])
    assert names == sorted(n for n, _ in llama4().named_parameters())
    fresh = llama4()
    gpudist.load_checkpoint(saved, fresh)
    state = results[0][0]
    assert all(torch.equal(fresh.state_dict()[k].to(v.device), v) for k, v in state.items())
