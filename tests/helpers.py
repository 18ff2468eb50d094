"""What several test modules share: the models, data, single-process references and rank functions they train
with. Test modules import these from here (as from backends.py or tolerances.py), never from one another.

One section per family of tests, named after the module the tests that use it most live in. Where two families
would share a name (``batch``, ``reference``, ``STEPS``, ...), the later sections prefix theirs (``gpu_``,
``hybrid_``, ``tp_``, ``pipeline_``).
"""

from __future__ import annotations

import copy

import torch
from torch import nn
from torch.nn import functional as F

import gpudist
from examples import lm, train
from examples.lm import TinyLM, as_sequential, lm_loss, tinylm_plan
from gpudist import (
    HybridShardedModel,
    HybridShardedOptimizer,
    PipelineParallelModel,
    ShardingConfiguration,
    TensorParallelModel,
)
from gpudist.comm import ReductionOperation, split_sizes
from gpudist.compression import CompressedChannel, Int8Compressor, OneBitCompressor, TopKCompressor
from gpudist.strategies import DATA_PARALLEL_PAIRS

from .tolerances import assert_matches_reference, reference_bound, reference_pair, sum_rtol, unit_roundoff

# ----------------------------------------------------------------------------------- data parallel (tests/test_ddp.py)

GLOBAL_BATCH = 12  # divisible by 1, 2, 3 and 4
STEPS = 10


class Net(nn.Module):
    """Odd sizes so buckets split in uneven places; an optional branch that is sometimes unused."""

    def __init__(self, with_branch: bool = False):
        super().__init__()
        self.fc1 = nn.Linear(7, 13)
        self.fc2 = nn.Linear(13, 5)
        self.norm = nn.LayerNorm(5)
        self.branch = nn.Linear(7, 5) if with_branch else None

    def forward(self, x, use_branch: bool = False):
        out = self.norm(self.fc2(torch.tanh(self.fc1(x))))
        return out + self.branch(x) if use_branch else out


def initial_state(with_branch: bool = False) -> dict:
    torch.manual_seed(0)  # built once, in the test process: threads would race on the global RNG
    return Net(with_branch).state_dict()


def fresh_net(state: dict, with_branch: bool = False) -> Net:
    net = Net(with_branch)
    net.load_state_dict(state)
    return net


def batch(step: int, rank: int = 0, world: int = 1, size: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(size, 7, generator=g), torch.randn(size, 5, generator=g)
    per = size // world
    return x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]


def flat(module: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in module.parameters()])


def train_steps(
    model,
    opt,
    stop: int,
    rank: int = 0,
    world: int = 1,
    start: int = 0,
    dtype=torch.float32,
    max_norm: float | None = None,
) -> None:
    """Plain training steps ``start..stop-1``: MSE on this rank's slice of each step's batch, ``clip_grad_norm_`` to
    ``max_norm`` if given (gpudist's optimizers clip by the same rule), step, zero_grad."""
    for step in range(start, stop):
        x, y = batch(step, rank, world)
        F.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        if max_norm is not None:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()


def single_process(
    state: dict,
    opt_cls=torch.optim.Adam,
    steps: int = STEPS,
    dtype=torch.float32,
    max_norm: float | None = None,
    **opt_kw,
) -> torch.Tensor:
    net = fresh_net(state).to(dtype)
    opt = opt_cls(net.parameters(), **({"lr": 1e-2} | opt_kw))
    train_steps(net, opt, steps, dtype=dtype, max_norm=max_norm)
    return flat(net)


# ------------------------------------------------------------------------------------------- ZeRO (tests/test_zero.py)

OPTIMIZERS = {
    "adam": (torch.optim.Adam, {"lr": 1e-2}),
    "adamw": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    "sgd": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "rmsprop": (torch.optim.RMSprop, {"lr": 1e-2}),  # no fused kernel: the generic path over owned views
    # capturable=True: the step counts and bias corrections on the device; a learning rate held as a device tensor
    "adam-capturable": (torch.optim.Adam, {"lr": 1e-2, "capturable": True}),
    "adamw-capturable-tensor-lr": (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "capturable": True}),
}


def optimizer_kw(opt_name: str) -> dict:
    """The keywords that build ``OPTIMIZERS[opt_name]`` (a learning rate of its own as a tensor where named so)."""
    kw = dict(OPTIMIZERS[opt_name][1])
    if opt_name.endswith("tensor-lr"):
        kw["lr"] = torch.tensor(kw["lr"])
    return kw


def reference_kw(opt_name: str) -> dict:
    """The keywords of the single-process torch reference of ``OPTIMIZERS[opt_name]`` (torch's capturable Adam does
    not step on the CPU; the arithmetic is the same)."""
    return {k: v for k, v in OPTIMIZERS[opt_name][1].items() if k != "capturable"}


STAGES = {
    1: DATA_PARALLEL_PAIRS["zero1"],
    2: DATA_PARALLEL_PAIRS["zero2"],
    3: DATA_PARALLEL_PAIRS["zero3"],
    "fsdp": DATA_PARALLEL_PAIRS["fsdp"],
}


def train_zero1(comm, state, opt_name="adam", wrap_model=True, steps=STEPS, config_kw=None, nan_step=None, stage=1):
    config = ShardingConfiguration(comm, **(config_kw or {}))
    net = fresh_net(state)
    model_cls, opt_cls = STAGES[stage]
    model = model_cls(net, config) if wrap_model else net
    cls = OPTIMIZERS[opt_name][0]
    opt = opt_cls(cls(model.parameters(), **optimizer_kw(opt_name)), config)
    step_bytes, skipped = [], []
    for step in range(steps):
        x, y = batch(step, comm.rank, comm.world_size)
        before = comm.stats.total_bytes
        F.mse_loss(model(x), y).backward()
        if step == nan_step and comm.rank == comm.world_size - 1:
            # One rank's gradient goes bad: the last element, which the last rank owns.
            list(model.parameters())[-1].grad[-1] = float("nan")
        after_backward = model.memory_per_rank() if wrap_model else None
        opt.step()
        opt.zero_grad()
        step_bytes.append(comm.stats.total_bytes - before)
        skipped.append(opt.last_step_skipped)
    meta = model.get_model_metadata() if wrap_model else None
    params = model.gather_full_parameters() if wrap_model else flat(net)
    return {
        "params": params,
        "bytes": step_bytes,
        "meta": meta,
        "skipped": skipped,
        "after_backward": after_backward,
        "state_bytes": opt.state_bytes(),
    }


# --------------------------------------------------------------------------- TinyLM under ZeRO-3 (tests/test_zero3.py)


def tiny_lm(dtype=torch.float32):
    return TinyLM(vocab=37, d_model=16, n_layers=2, n_heads=2, seq_len=8, seed=3).to(dtype)


def lm_batch(step, rank=0, world=1, size=12):
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, 37, (size, 9), generator=g)
    per = size // world
    part = tokens[rank * per : (rank + 1) * per]
    return part[:, :-1], part[:, 1:]


# ----------------------------------------------------------------------------- compression (tests/test_compression.py)

LOSSY = {
    "topk": TopKCompressor(0.05),
    "int8": Int8Compressor(),
    "1bit": OneBitCompressor(block_size=64),
    "int8-stochastic": Int8Compressor(block_size=32, stochastic=True),
}


def average_rtol(world: int) -> float:
    """Relative bound (against the mean of |x_i|) of an fp32 average of ``world`` values in any order: world - 1
    additions plus a rounded 1/N and its product (or one division), world + 1 roundings on any path."""
    return sum_rtol(world + 2)


def lossless_vs_plain(comm, compressor=None, n=0):
    """(compressed, plain, mean |g| over ranks) for 3 all-reduces and 3 reduce-scatters of random ``g``."""
    torch.manual_seed(comm.rank)
    out = []
    for scatter in (False, True):
        channel = CompressedChannel(comm, compressor, n, device=comm.device, scatter=scatter)
        for _ in range(3):  # later calls skip the cross-rank check: still right
            g = torch.randn(n).to(comm.device)
            plain, magnitude = g.clone(), g.abs()
            comm.all_reduce(plain, ReductionOperation.AVERAGE)
            comm.all_reduce(magnitude, ReductionOperation.AVERAGE)
            if scatter:
                lo = sum(split_sizes(n, comm.world_size)[: comm.rank])
                mine = torch.empty(split_sizes(n, comm.world_size)[comm.rank], device=comm.device)
                channel.reduce_scatter(g, mine)
                out.append((mine, plain[lo : lo + mine.numel()], magnitude[lo : lo + mine.numel()]))
            else:
                channel.all_reduce(g)
                out.append((g, plain, magnitude))
    return out


def assert_lossless(results: list, world: int) -> None:
    """Each pair of :func:`lossless_vs_plain` (one rank's): two fp32 averages of the same values, summed in other
    orders or scaled differently, each within ``average_rtol(world)`` of the exact mean relative to mean |g| (itself
    an fp32 average, hence its own factor)."""
    rtol = 2 * average_rtol(world) * (1 + average_rtol(world))
    for got, want, magnitude in results:
        err, bound = (got - want).abs(), rtol * magnitude
        assert bool((err <= bound).all()), f"|compressed - plain| = {float((err - bound).max() + bound.max()):.3g}"


def conservation(comm, compressor=None, n=0, scatter=False, steps=12):
    """Sums over ``steps`` of the applied (compressed) and true (plain) averages, what is still pending, and the
    rounding bound on ``|applied + pending - true|``.

    Conservation is exact in real arithmetic; each fp32 rounding breaks it by at most u (2^-24) times what it
    rounds. Per step, with A the largest |g| + |worker residual| and S the largest |server residual| on any rank:
    forming grad + residual and the new residual acc - decoded round twice on each worker (<= u A + 2u A); the
    average of N decoded values, N roundings (<= N u A); the server's second quantization twice (<= 3u (A + S));
    the plain average N + 1 (<= (N + 1) u A). Summed: u ((2N + 7) A + 3 S) per step, and one more u A for the
    second-order terms and the float64 sums here. At the end, the mean of the worker residuals adds N + 1 roundings
    of the largest one.
    """
    gen = torch.Generator().manual_seed(100 + comm.rank)
    device = comm.device
    channel = CompressedChannel(comm, compressor, n, device=device, scatter=scatter)
    world = comm.world_size
    sizes = split_sizes(n, world)
    lo, size = sum(sizes[: comm.rank]), sizes[comm.rank]
    applied = torch.zeros(n if not scatter else size, dtype=torch.float64, device=device)
    true = torch.zeros_like(applied)
    bound = 0.0
    for step in range(steps):
        g = (torch.randn(n, generator=gen) * (1 + step % 3) + (0.5 if comm.rank else -0.5)).to(device)
        worker, held = channel.worker_residual(), channel.server_residual()
        server = held[1].abs().max() if held is not None and held[1].numel() else g.new_zeros(())
        largest = torch.stack([(g.abs() + worker.abs()).max(), server])
        comm.all_reduce(largest, ReductionOperation.MAX)
        bound += (2 * world + 8) * float(largest[0]) + 3 * float(largest[1])
        plain = g.clone()
        comm.all_reduce(plain, ReductionOperation.AVERAGE)
        if scatter:
            out = torch.empty(size, device=device)
            channel.reduce_scatter(g, out)
            applied += out.double()
            true += plain[lo : lo + size].double()
        else:
            channel.all_reduce(g)
            applied += g.double()
            true += plain.double()
    worker = channel.worker_residual().clone()
    largest = worker.abs().max()
    comm.all_reduce(largest, ReductionOperation.MAX)
    bound += (world + 1) * float(largest)
    comm.all_reduce(worker, ReductionOperation.AVERAGE)  # pending on the workers: the mean of their residuals
    pending = worker.double() if not scatter else worker[lo : lo + size].double()
    if channel.server_residual() is not None:  # the two-phase all-reduce's second quantization
        server = torch.zeros(n, device=device)
        start, values = channel.server_residual()
        server[start : start + values.numel()] = values
        comm.all_reduce(server, ReductionOperation.SUM)
        pending = pending + server.double()
    return applied.cpu(), pending.cpu(), true.cpu(), unit_roundoff(torch.float32) * bound


# --------------------------------------------------------------------- examples/train.py (tests/test_example_train.py)

METRICS_ROUNDING = 5e-7
"""metrics.json keeps losses to 6 decimals (train.py): half a unit of the last one on top of the bound."""


def script_reference(cfg, dtype=torch.float32) -> tuple[dict[str, torch.Tensor], list[float]]:
    """What ``train.train(comm, cfg)`` computes, on one process over the whole global batch in plain PyTorch (no
    gpudist at all): the trained parameters by name and the loss of every step."""
    corpus = lm.SyntheticCorpus(cfg.seed, cfg.seq_len)
    net = train.make_model(cfg).to(dtype)
    opt = train.make_optimizer(net.parameters(), cfg.lr, cfg.optimizer)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: train.lr_factor(step, cfg.steps))
    losses = []
    for step in range(cfg.steps):
        x, y = corpus.batches(step, cfg.global_batch)
        loss = lm.lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        schedule.step()
        losses.append(loss.item())
    return {name: p.detach() for name, p in net.named_parameters()}, losses


def script_losses(**cfg) -> tuple[list[float], list[float]]:
    """The per-step losses of :func:`script_reference` for ``train.TrainConfig(**cfg)``, in float32 and float64."""
    (_, losses32), (_, losses64) = reference_pair(script_reference, train.TrainConfig(**cfg))
    return losses32, losses64


def assert_losses_match(got: list[float], ref32: list[float], ref64: list[float], what: str = "losses") -> None:
    """Per-step losses from metrics.json against the float64 reference: :func:`reference_bound` plus the file's
    6-decimal rounding."""
    bound = reference_bound(ref32, ref64) + METRICS_ROUNDING
    err = max(abs(a - b) for a, b in zip(got, ref64, strict=True))
    assert err <= bound, f"{what}: max |got - float64 reference| = {err:.3g} exceeds {bound:.3g}\n{got}\n{ref64}"


# ----------------------------------------------------------------------------------- pipeline (tests/test_pipeline.py)

D = 8


def _mlp(blocks: int = 6) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *[nn.Sequential(nn.Linear(D, D), nn.Tanh()) if i % 2 else nn.Linear(D, D) for i in range(blocks)]
    )


_MLP = _mlp()


def mlp() -> nn.Sequential:
    """The same 6-block model on every rank (a copy: in-memory ranks are threads sharing torch's global RNG)."""
    return copy.deepcopy(_MLP)


def global_batch(step: int, n: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, D, generator=g), torch.randn(n, D, generator=g)


def _cast(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() else t  # token ids stay integers


def pipeline_reference(
    steps: int = 3, build=mlp, batch=global_batch, loss_fn=F.mse_loss, dtype=torch.float32
) -> tuple[torch.Tensor, list[float]]:
    """Single-process training on the global batch."""
    net = build().to(dtype)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        x, y = (_cast(t, dtype) for t in batch(step))
        loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach(), losses


def pipeline_train(
    comm,
    stages=None,
    micro=4,
    schedule="1f1b",
    steps=3,
    build=mlp,
    batch=global_batch,
    loss_fn=F.mse_loss,
    balance="parameters",
):
    config = ShardingConfiguration(comm)
    model = PipelineParallelModel(
        build(), config, num_stages=stages, micro_batches=micro, schedule=schedule, balance=balance
    )
    params = list(model.parameters())  # a parameter-free stage gets no optimizer (torch refuses an empty list)
    opt = torch.optim.Adam(params, lr=1e-2) if params else None
    losses = []
    dp, d = model.data_parallel_size, model.data_parallel_rank
    for step in range(steps):
        x, y = batch(step)
        n = x.shape[0] // dp
        losses.append(model.train_step(x[d * n : (d + 1) * n], y[d * n : (d + 1) * n], loss_fn, opt))
    return model.gather_full_parameters(), losses, model.last_schedule["max_in_flight"], model.stage_blocks


class PatternNet:
    """A sequence of blocks spelled by a pattern: ``L`` a Linear(D, D), ``T`` a Tanh (no parameters), e.g. ``"LTLTL"``;
    the weights come from a generator seeded by the pattern, not torch's global RNG (which in-memory ranks, threads
    of one process, share), so every rank and the reference build the same model. A class so that it pickles for
    Gloo ranks."""

    def __init__(self, pattern: str):
        self.pattern = pattern

    def __call__(self) -> nn.Sequential:
        net = nn.Sequential(*[nn.Linear(D, D) if c == "L" else nn.Tanh() for c in self.pattern])
        g = torch.Generator().manual_seed(sum(map(ord, self.pattern)))
        with torch.no_grad():
            for p in net.parameters():
                p.copy_(torch.randn(p.shape, generator=g) / D**0.5)
        return net


def batch_of_24(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A global batch that 3, 4, 6 and 8 micro-batches divide."""
    return global_batch(step, n=24)


def check_training(params: torch.Tensor, losses: list[float], want: tuple) -> None:
    """Parameters and per-step losses against ``reference_pair(pipeline_reference, ...)``."""
    (params32, losses32), (params64, losses64) = want
    assert_matches_reference(params, params32, params64, what="parameters")
    assert_matches_reference(losses, losses32, losses64, what="losses")


def varying_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    return global_batch(step, n=[16, 8, 8, 24][step])


def pipeline_train_varying(comm, stages, micro):
    model = PipelineParallelModel(mlp(), ShardingConfiguration(comm), num_stages=stages, micro_batches=micro)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    losses = []
    for step in range(4):
        losses.append(model.train_step(*varying_batch(step), F.mse_loss, opt))
        model.predict(varying_batch(step)[0][:3])  # its own shape message and activation in between
    return model.gather_full_parameters(), losses


# --------------------------------------------------------------------- tensor parallel (tests/test_tensor_parallel.py)

TP_LM = {"vocab": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "seq_len": 16, "seed": 0}
TP_GLOBAL_BATCH = 8
TP_STEPS = 5
TP_OPTIMIZERS = {
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    "sgd": lambda params: torch.optim.SGD(params, lr=0.5, momentum=0.9),
}


def tp_lm_batch(size: int = TP_GLOBAL_BATCH, seq: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randint(0, 64, (size, seq), generator=g), torch.randint(0, 64, (size, seq), generator=g)


def tp_single_process_lm(opt_name: str, steps: int = TP_STEPS, dtype=torch.float32) -> tuple[list[float], torch.Tensor]:
    model = TinyLM(**TP_LM).to(dtype)
    opt = TP_OPTIMIZERS[opt_name](model.parameters())
    x, y = tp_lm_batch()
    losses = []
    for _ in range(steps):
        loss = lm_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, flat(model)


def tp_train_lm(comm, tp, opt_name, x, y, idiomatic=False, steps=TP_STEPS):
    model = TensorParallelModel(TinyLM(**TP_LM), ShardingConfiguration(comm), tinylm_plan, tensor_parallel_size=tp)
    opt = TP_OPTIMIZERS[opt_name](model.parameters())
    per = x.shape[0] // model.data_parallel_size
    mine = slice(model.data_parallel_rank * per, (model.data_parallel_rank + 1) * per)  # this replica's rows
    losses = []
    for _ in range(steps):
        if idiomatic:  # the plain loop: data-parallel averaging must happen inside backward
            loss = model.cross_entropy(model(x[mine]), y[mine])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        else:
            losses.append(model.train_step(x[mine], y[mine], optimizer=opt))
    return {
        "losses": losses,
        "params": model.gather_full_parameters(),
        "meta": model.get_model_metadata(),
        "local_numel": sum(p.numel() for p in model.parameters()),
        "ranks": (
            model.pipeline_parallel_rank,
            model.pipeline_parallel_size,
            model.data_parallel_rank,
            model.data_parallel_size,
            model.tensor_parallel_rank,
            model.tensor_parallel_size,
        ),
    }


# ------------------------------------------------------ every data-parallel strategy on any device (tests/test_gpu.py)

GPU_PAIRS = DATA_PARALLEL_PAIRS
GPU_STEPS, GPU_BATCH = 5, 16


with torch.random.fork_rng(devices=[]):
    torch.manual_seed(0)
    _GPU_NET = nn.Sequential(nn.Linear(9, 33), nn.GELU(), nn.Linear(33, 17), nn.GELU(), nn.Linear(17, 5))


def gpu_net(device) -> nn.Module:
    """A copy of one template: in-memory ranks are threads sharing torch's global RNG, so seeding and building
    on each of them races (ranks, and the reference, would start from different weights now and then)."""
    return copy.deepcopy(_GPU_NET).to(device)


def gpu_batch(step: int, device, rank: int = 0, world: int = 1):
    g = torch.Generator().manual_seed(100 + step)
    x, y = torch.randn(GPU_BATCH, 9, generator=g), torch.randn(GPU_BATCH, 5, generator=g)
    per = GPU_BATCH // world
    return x[rank * per : (rank + 1) * per].to(device), y[rank * per : (rank + 1) * per].to(device)


def gpu_reference(device, dtype=torch.float32) -> torch.Tensor:
    torch.backends.cuda.matmul.allow_tf32 = False
    model = gpu_net(device).to(dtype)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(GPU_STEPS):
        x, y = (t.to(dtype) for t in gpu_batch(step, device))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()]).cpu()


def gpu_train(comm, strategy: str, **config) -> torch.Tensor:
    torch.backends.cuda.matmul.allow_tf32 = False
    device = comm.device
    config = gpudist.ShardingConfiguration(comm, **config)
    model_cls, opt_cls = GPU_PAIRS[strategy]
    model = model_cls(gpu_net(device), config)
    opt = opt_cls(torch.optim.Adam(model.parameters(), lr=1e-2), config)
    for step in range(GPU_STEPS):
        x, y = gpu_batch(step, device, comm.rank, comm.world_size)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    return model.gather_full_parameters().cpu()


# ------------------------------------------------------------------------------------ 3D hybrid (tests/test_hybrid.py)

HYBRID_VOCAB, HYBRID_STEPS = 32, 3


def hybrid_lm() -> TinyLM:
    """Built from its seed alone (no global RNG), so every in-memory rank (a thread) builds the same model."""
    return TinyLM(HYBRID_VOCAB, 16, n_layers=2, n_heads=2, seq_len=8, seed=0)


def hybrid_batch(step: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    tokens = torch.randint(0, HYBRID_VOCAB, (n, 9), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def hybrid_optimizer(params, kind: str) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.5, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.01)


def hybrid_reference(kind: str = "adamw", dtype=torch.float32) -> tuple[torch.Tensor, list[float]]:
    net = hybrid_lm().to(dtype)
    opt = hybrid_optimizer(net.parameters(), kind)
    losses = []
    for step in range(HYBRID_STEPS):
        x, y = hybrid_batch(step)
        loss = lm_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return torch.nn.utils.parameters_to_vector(net.parameters()).detach(), losses


def hybrid_train(comm, pp=2, tp=2, dp=-1, zero_stage=1, kind="adamw", schedule="1f1b", max_grad_norm=None):
    config = ShardingConfiguration(comm, max_grad_norm=max_grad_norm)
    model = HybridShardedModel(
        hybrid_lm(), config, pp, tp, dp, plan=tinylm_plan, blocks=as_sequential, micro_batches=2, schedule=schedule
    )
    opt = HybridShardedOptimizer(hybrid_optimizer(model.parameters(), kind), config, pp, tp, dp, zero_stage=zero_stage)
    replicas, d = model.data_parallel_size, model.data_parallel_rank
    losses = []
    for step in range(HYBRID_STEPS):
        x, y = hybrid_batch(step)
        n = x.shape[0] // replicas
        losses.append(model.train_step(x[d * n : (d + 1) * n], y[d * n : (d + 1) * n], optimizer=opt))
    ranks = (model.pipeline_parallel_rank, model.data_parallel_rank, model.tensor_parallel_rank)
    if max_grad_norm is not None:
        return model.gather_full_parameters(), losses, opt.last_grad_norm
    return model.gather_full_parameters(), losses, ranks, model.predict(hybrid_batch(0)[0])


def hybrid_check(results, kind: str, world: int) -> None:
    (params32, losses32), (params64, losses64) = reference_pair(hybrid_reference, kind)
    logits = hybrid_lm()(hybrid_batch(0)[0]).detach()
    for params, losses, _, predicted in results:
        assert_matches_reference(params, params32, params64, what="parameters")
        assert_matches_reference(losses, losses32, losses64, what="losses")
        assert predicted.shape == logits.shape  # full logits on every rank (after training, so values differ)
    assert sorted(r[2] for r in results) == sorted({r[2] for r in results}) and len(results) == world
