"""What the elastic test modules (tests/test_elastic.py, tests/test_elastic_live.py) share: the elastic job's
single-process reference in any dtype. Test modules import it from here, never from one another.
"""

from __future__ import annotations

import torch
from torch import nn

from gpudist.testing import elastic_job


def reference(steps: int, dtype=torch.float32) -> torch.Tensor:
    """``elastic_job.reference(steps)`` (single-process training on the global batch) in ``dtype``."""
    model = elastic_job.build_model().to(dtype)
    opt = elastic_job.make_optimizer(model.parameters())
    for step in range(steps):
        x, y = (t.to(dtype) for t in elastic_job.batch(step))
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    if dtype == torch.float32:  # the same steps as the job's own reference, bit for bit
        assert torch.equal(flat, elastic_job.reference(steps))
    return flat
