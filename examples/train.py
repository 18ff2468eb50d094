"""Train a small transformer language model with a gpudist strategy, on a corpus this repository generates.

Standalone, it spawns N local Gloo ranks on the CPU:

    python examples/train.py --strategy ddp --world-size 2

Under a launcher each process is one rank (the same code path):

    torchrun --nproc-per-node 2 examples/train.py --strategy ddp

Every rank builds the same model from the seed and trains on its slice of each step's global batch (so N ranks
together take exactly the steps one process would take on the whole batch). At the end rank 0 checks that all
replicas hold identical parameters and writes OUT/metrics.json, OUT/loss.png and OUT/model.safetensors. The exit
code is 0 only if the replicas agree and the loss went down.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import json
import math
import os
import signal
import struct
import sys
import time
import zlib
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as st_save

import gpudist
from gpudist.bench import environment
from gpudist.fileio import atomic_write_bytes
from gpudist.launch import WorkerPool, detect_environment

if __package__:  # imported as examples.train (the tests)
    from .lm import VOCAB, SyntheticCorpus, TinyLM, as_sequential, lm_loss, tinylm_plan
else:  # run as a script (python examples/train.py, torchrun, mpirun): its own folder is on sys.path
    from lm import VOCAB, SyntheticCorpus, TinyLM, as_sequential, lm_loss, tinylm_plan

# Strategy name -> (model class, optimizer class) in gpudist. A strategy is offered once gpudist exports both.
# FSDP shards like ZeRO-3 (one row in docs/strategies.md's table), so it pairs with ZeRO3Optimizer.
STRATEGIES: dict[str, tuple[str, str]] = {
    "ddp": ("DDPModel", "DDPOptimizer"),
    "zero1": ("ZeRO1Model", "ZeRO1Optimizer"),
    "zero2": ("ZeRO2Model", "ZeRO2Optimizer"),
    "zero3": ("ZeRO3Model", "ZeRO3Optimizer"),
    "fsdp": ("FSDPModel", "ZeRO3Optimizer"),
    "pipeline": ("PipelineParallelModel", "DDPOptimizer"),
    "tensor": ("TensorParallelModel", "DDPOptimizer"),
    "hybrid": ("HybridShardedModel", "HybridShardedOptimizer"),
    "async": ("", "AsyncSGDOptimizer"),  # a plain module: workers push to parameter-server shards, no wrapper
    "elastic": ("DDPModel", "ElasticOptimizer"),  # resumes from its newest checkpoint at any world size
}
SCHEDULED = {"pipeline", "tensor", "hybrid"}
"""Strategies trained through model.train_step (their backward is scheduled across ranks), not loss.backward()."""
COMM_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16}  # None: gradients' own dtype
LAUNCHER_RANK_VARS = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
VAL_SEQUENCES = 256
"""Held-out sequences for the final evaluation; the entropy floor is measured on the same ones."""
OP_TIMEOUT = 300.0
"""Seconds a collective waits for a peer before failing the run (a step takes well under a second here)."""


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """One training run. The defaults are the README's main job: about 80 s on 2 CPU cores, to within ~0.01 nats
    of the corpus's entropy floor. lr is 10x the usual 3e-4: right for a model this small and a run this short."""

    strategy: str = "ddp"
    steps: int = 1500
    global_batch: int = 32
    """Sequences per step over all ranks (each rank takes global_batch / world_size of them)."""
    lr: float = 3e-3
    seed: int = 0
    comm_dtype: str = "fp32"
    optimizer: str = "adamw"
    """"adamw" or "sgd" (momentum 0.9)."""
    compression: str | None = None
    """A gpudist.compression spec ("topk:0.01", "int8", "1bit"): gradients travel compressed, with error feedback
    (GradientCompressionOptimizer around the strategy's optimizer; ddp, zero1 and zero2)."""
    compression_warmup: int = 10
    """Uncompressed steps before compression starts."""
    error_feedback: bool = True
    pp: int = 2
    """Pipeline stages (--strategy pipeline, hybrid); the ranks left over form data-parallel replicas."""
    tp: int = 2
    """Tensor-parallel ranks per layer (--strategy tensor, hybrid)."""
    micro_batches: int = 4
    """Micro-batches per step and replica (--strategy pipeline)."""
    max_staleness: int = 2
    """Versions a gradient may lag behind (--strategy async; 0 is synchronous SGD)."""
    checkpoint_every: int = 50
    """Steps between checkpoints (--strategy elastic; they go to OUT/checkpoints)."""
    live: bool = False
    """--strategy elastic without restarts: gpudist.live workers that survive a member's death in-process."""
    zero_stage: int = 0
    """Live mode: 0 (replicated state, DDP), 1, 2 or 3 (sharded optimizer state; 3 shards the parameters too)."""
    redundancy: str | None = None
    """Live mode with zero_stage 1, 2 or 3: "buddy" mirrors each rank's shard on the next rank (no disk on a death)."""
    kill_at: int | None = None
    """Live mode, a demo of a failure: the last of the first workers SIGKILLs itself in step kill_at's forward."""
    replacements: int = 1
    """Live mode: workers the launcher starts in place of ones that die."""
    compress_momentum: bool = False
    """Communicate the momentum instead of the gradient (momentum SGD, ddp; what 1-bit needs to converge)."""
    out: str = "runs/ddp-w2"
    log_every: int = 25
    seq_len: int = 64
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4


def available_strategies() -> list[str]:
    """The strategies this gpudist can run now (the others are planned)."""
    return [name for name, classes in STRATEGIES.items() if all(not c or hasattr(gpudist, c) for c in classes)]


def make_optimizer(params: Any, lr: float, kind: str = "adamw") -> torch.optim.Optimizer:
    """The inner optimizer every strategy wraps (and the single-process reference uses unwrapped). ``"sgd"`` is
    momentum SGD, the setting error feedback was designed for (use --lr about 0.03)."""
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.AdamW(params, lr=lr, betas=(0.9, 0.95), weight_decay=0.01)


def lr_factor(step: int, steps: int, warmup: int = 20) -> float:
    """Learning-rate multiplier at ``step``: linear warmup, then cosine decay to 10% (lets the loss settle)."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress)))


def make_model(cfg: TrainConfig) -> TinyLM:
    return TinyLM(SyntheticCorpus.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.seq_len, seed=cfg.seed)


# ---------------------------------------------------------------------------------------------------------------------
# The training run (every rank)


def train(comm: gpudist.CommunicationBackend, cfg: TrainConfig) -> dict[str, Any]:
    """Runs ``cfg`` on this rank; rank 0 also evaluates and writes the outputs. Returns this rank's verdict."""
    rank, world = comm.rank, comm.world_size
    model_cls, optim_cls = (getattr(gpudist, name) if name else None for name in STRATEGIES[cfg.strategy])
    corpus = SyntheticCorpus(cfg.seed, cfg.seq_len)
    device = comm.device  # CPU on Gloo/MPI; this rank's GPU on NCCL (gpudist.init() picks it under torchrun)
    net = make_model(cfg).to(device)
    comm_dtype = COMM_DTYPES[cfg.comm_dtype]
    config = gpudist.ShardingConfiguration(comm, communication_dtype=comm_dtype)
    loss_fn = lm_loss
    if cfg.strategy == "pipeline":
        model = model_cls(as_sequential(net), config, num_stages=cfg.pp, micro_batches=cfg.micro_batches)
    elif cfg.strategy == "tensor":
        model = model_cls(net, config, tinylm_plan, tensor_parallel_size=cfg.tp)
        loss_fn = None  # the vocabulary-parallel cross-entropy: full logits are never gathered
    elif cfg.strategy == "hybrid":
        model = model_cls(
            net, config, cfg.pp, cfg.tp, plan=tinylm_plan, blocks=as_sequential, micro_batches=cfg.micro_batches
        )
        loss_fn = None
    elif model_cls is None:
        model = net  # async: no wrapper (a DDPModel would all-reduce in every backward and wait for every rank)
    else:
        model = model_cls(net, config)
    # Each data-parallel replica reads its own slice of the batch (the ranks of one replica the same slice).
    data_rank, data_size = (
        (model.data_parallel_rank, model.data_parallel_size) if cfg.strategy in SCHEDULED else (rank, world)
    )
    torch_opt = make_optimizer(model.parameters(), cfg.lr, cfg.optimizer)
    if cfg.strategy == "hybrid":
        opt = optim_cls(torch_opt, config, cfg.pp, cfg.tp)
    elif cfg.strategy == "async":
        opt = optim_cls(torch_opt, config, max_staleness=cfg.max_staleness)
    elif cfg.strategy == "elastic":  # resumes from OUT/checkpoints when a restart (or an earlier run) left one
        opt = optim_cls(
            torch_opt, config, Path(cfg.out) / "checkpoints", cfg.checkpoint_every, batch_size=cfg.global_batch // world
        )
    else:
        opt = optim_cls(torch_opt, config)
    if cfg.compression is not None:
        opt = gpudist.GradientCompressionOptimizer(
            opt,
            config,
            cfg.compression,
            warmup_steps=cfg.compression_warmup,
            error_feedback=cfg.error_feedback,
            compress="momentum" if cfg.compress_momentum else "gradients",
        )
    # The wrapper is a torch.optim.Optimizer sharing the inner one's param_groups, so schedulers work unchanged.
    start = getattr(opt, "step_count", 0)  # elastic: the step its checkpoint was taken at
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: lr_factor(s + start, steps=cfg.steps))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    progress = Progress(cfg.steps, tokens_per_step) if rank == 0 else None

    losses = torch.zeros(cfg.steps)  # this rank's loss per step; averaged over ranks once, after the loop
    losses[:start] = math.nan  # steps a previous run did
    step_times, comm_bytes = [], []
    window_start = start
    started = time.perf_counter()
    for step in range(start, cfg.steps):
        # Timed end to end as a user waits for it, data included (generating a rank's slice: ~4 ms of ~45 ms).
        t0, bytes0 = time.perf_counter(), bytes_moved(comm, opt)
        x, y = (t.to(device) for t in corpus.batches(step, cfg.global_batch, data_rank, data_size))
        if cfg.strategy in SCHEDULED:
            losses[step] = model.train_step(x, y, loss_fn, opt)  # forward, backward and step, scheduled
        else:
            loss = lm_loss(model(x), y)  # the idiomatic PyTorch loop, unchanged: the strategy works inside it
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
        schedule.step()
        step_times.append(time.perf_counter() - t0)
        # Scheduled strategies talk through sub-groups (stages, replicas), which the model counts itself.
        comm_bytes.append(model.last_step_bytes if cfg.strategy in SCHEDULED else bytes_moved(comm, opt) - bytes0)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            # The displayed loss is the global batch's (mean over ranks), as a single process would report it.
            # This small all-reduce sits outside the timed step, so bytes/step counts the strategy's traffic only.
            window = losses[window_start : step + 1].mean().reshape(1).to(device)
            comm.all_reduce(window, "average")
            if progress is not None:
                progress.update(
                    step + 1, float(window), step_times[window_start - start :], comm_bytes[window_start - start :]
                )
            window_start = step + 1
    if hasattr(opt, "finish"):
        opt.finish()  # async: wait for the last rounds (same parameters everywhere); elastic: commit the checkpoint
    train_seconds = time.perf_counter() - started
    if progress is not None:
        progress.close()

    losses = losses.to(device)
    comm.all_reduce(losses, "average")  # equal local batches: the mean of rank means is the global batch's mean
    losses = losses.cpu()
    flat, identical, max_diff = replicas_identical(comm, model)
    verdict, outcome = judge(rank, losses, identical, max_diff, cfg.steps)
    if rank != 0:
        return verdict

    write_outputs(
        cfg,
        world,
        flat,
        corpus,
        {
            **outcome,
            **throughput(tokens_per_step, step_times, comm_bytes, train_seconds),
            "metadata": model.get_model_metadata()
            if isinstance(model, gpudist.ShardedModel)
            else {"strategy": cfg.strategy, "max_staleness": cfg.max_staleness, "async": opt.stats},
            "compression": opt.communication_report() if cfg.compression is not None else None,
            "comm_stats": comm.stats.as_dict(),
        },
    )
    return verdict


def judge(
    rank: int, losses: torch.Tensor, identical: bool, max_diff: float, steps: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """This rank's verdict on the run (replicas identical and the loss fell), and the metrics that say so: the loss
    of every step (NaN: a previous run did it), the first trained step's and the mean of the last tenth's."""
    trained = (~losses.isnan()).nonzero()
    start = int(trained[0]) if len(trained) else 0
    tail = max(1, steps // 10)
    initial, final = float(losses[start]), float(losses[-tail:].nanmean())
    verdict = {"rank": rank, "replicas_identical": identical, "loss_decreased": final < initial}
    verdict["ok"] = identical and verdict["loss_decreased"]
    outcome = {
        "loss": [round(v, 6) for v in losses.tolist()],
        "initial_loss": initial,
        "final_loss": final,
        "loss_decreased": verdict["loss_decreased"],
        "replicas_identical": identical,
        "replica_max_abs_diff": max_diff,
    }
    return verdict, outcome


def throughput(
    tokens_per_step: int, step_times: list[float], comm_bytes: list[int], train_seconds: float
) -> dict[str, Any]:
    """Step times, tokens/s and communication per step, for metrics.json."""
    measured = step_times[1:] or step_times  # step 0 pays for one-time setup (allocations, first bucket build)
    return {
        "tokens_per_step": tokens_per_step,
        "step_time_s": [round(t, 6) for t in step_times],
        "comm_bytes": comm_bytes,
        "tokens_per_s": tokens_per_step * len(measured) / sum(measured),
        "comm_bytes_per_step": sorted(comm_bytes)[len(comm_bytes) // 2],
        "train_seconds": train_seconds,
    }


def write_outputs(
    cfg: TrainConfig, world: int, flat: torch.Tensor, corpus: SyntheticCorpus, fields: dict[str, Any]
) -> dict[str, Any]:
    """Rank 0's outputs: evaluates a local copy built from the gathered parameters ``flat``, writes OUT/metrics.json
    (``fields`` plus the evaluation), loss.png and model.safetensors, prints the summary, and returns the metrics."""
    # No collectives (a sharded strategy's gather is one, and the other ranks have returned), so this works
    # whatever the strategy.
    trained = make_model(cfg)
    torch.nn.utils.vector_to_parameters(flat.cpu(), trained.parameters())
    metrics = {
        "config": dataclasses.asdict(cfg) | {"world_size": world},
        "parameter_count": sum(p.numel() for p in trained.parameters()),
        **fields,
        "val_loss": evaluate(trained, corpus),
        "log_vocab": math.log(corpus.vocab_size),
        "entropy_floor": corpus.entropy_floor(VAL_SEQUENCES, split="val"),
        "sample": SyntheticCorpus.decode(generate(trained, [VOCAB.index("the")], 40, cfg.seed)),
        "environment": environment(),
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "metrics.json", json.dumps(metrics, indent=1, default=str).encode())
    atomic_write_bytes(out / "loss.png", plot_loss(metrics))
    # Named tensors (the tied head is stored once, as tok.weight); safetensors, never pickle.
    state = {name: p.detach().contiguous() for name, p in trained.named_parameters()}
    atomic_write_bytes(out / "model.safetensors", st_save(state, metadata={"format": "gpudist-example-tinylm"}))
    report(metrics, out)
    return metrics


# ---------------------------------------------------------------------------------------------------------------------
# Live mode (--strategy elastic --live): one gpudist.live worker per process, no restarts


def train_live(cfg: TrainConfig, world: int) -> dict[str, Any]:
    """One worker of a live elastic job (started by :func:`launch_live` through ``python -m gpudist.live``).

    The members train each step's whole global batch split over however many of them there are (a dead member's
    share goes to the survivors; a replacement takes one back), so the steps are the same at any world size. At
    the end they check that their replicas are identical and rank 0 writes the outputs, with the live events.
    Returns this worker's verdict (None: the job finished before this worker, a late replacement, was admitted).
    """
    from gpudist.flat import exchange_bytes
    from gpudist.live import JobFinished, LiveElasticTrainer, Membership

    started = time.time()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # the workers share the machine's cores
    corpus = SyntheticCorpus(cfg.seed, cfg.seq_len)
    live_dir = Path(cfg.out) / "live"
    live_dir.mkdir(parents=True, exist_ok=True)
    membership = Membership.connect(min_size=world)
    global_losses: dict[int, float] = {}  # step -> the global batch's loss (every member of the step knows it)

    def step_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Called inside every attempt of a step (a retry after a failure too), once that attempt's generation's
        model and optimizer are in place: sets the step's learning rate, all-reduces the global batch's loss for
        the log, and returns this share's loss summed over its sequences (what the trainer scales by N / G)."""
        step = trainer.step_count
        if step == cfg.kill_at and membership.id == world:  # the demo failure: the last initial worker dies
            (live_dir / f"kill-{membership.id}.json").write_text(
                json.dumps({"member": membership.id, "step": step, "time": time.time()})
            )
            os.kill(os.getpid(), signal.SIGKILL)
        for group in trainer.optimizer.param_groups:  # each generation builds a fresh optimizer: set it every attempt
            group["lr"] = cfg.lr * lr_factor(step, steps=cfg.steps)
        loss = lm_loss(logits, targets) * logits.shape[0]
        total = loss.detach().reshape(1).clone()
        trainer.comm.all_reduce(total, "sum")
        global_losses[step] = float(total) / cfg.global_batch
        return loss

    try:
        trainer = LiveElasticTrainer(
            lambda: make_model(cfg),
            lambda params: make_optimizer(params, cfg.lr, cfg.optimizer),
            membership,
            Path(cfg.out) / "checkpoints",
            cfg.checkpoint_every,
            zero_stage=cfg.zero_stage,
            redundancy=cfg.redundancy,
        )
    except JobFinished:
        print(f"worker {membership.id}: the job finished before it was admitted; nothing to do", flush=True)
        membership.close()
        return None
    tokens_per_step = cfg.global_batch * cfg.seq_len
    progress = Progress(cfg.steps, tokens_per_step)
    finished_at: dict[int, float] = {}  # steps completed -> when (time.time())
    step_times, comm_bytes = [], []
    shown = window_start = trainer.step_count
    while trainer.step_count < cfg.steps:
        if cfg.kill_at is not None and cfg.replacements and trainer.step_count == cfg.steps - 2:
            wait_for_replacement(membership, world)
        t0, comm, bytes0 = time.perf_counter(), trainer.comm, trainer.comm.stats.total_bytes
        trainer.train_step(lambda step: corpus.batches(step, cfg.global_batch), step_loss)
        finished_at[trainer.step_count] = time.time()
        step_times.append(time.perf_counter() - t0)
        comm_bytes.append(trainer.comm.stats.total_bytes - (bytes0 if trainer.comm is comm else 0))
        for event in trainer.events[shown:]:
            if trainer.rank == 0:
                print(describe_generation(event), flush=True)
        shown = len(trainer.events)
        step = trainer.step_count
        if trainer.rank == 0 and (step % cfg.log_every == 0 or step == cfg.steps):
            window = [global_losses[s] for s in range(window_start, step) if s in global_losses]
            if window:
                progress.update(step, sum(window) / len(window), step_times, comm_bytes)
            window_start = step
    train_seconds = time.time() - started
    trainer.finish()  # commits the last checkpoint
    membership.finish()  # a replacement still waiting to join stops waiting
    progress.close()

    comm, rank = trainer.comm, trainer.rank
    steps = {
        int(k): v
        for blob in exchange_bytes(comm, json.dumps(global_losses).encode())
        for k, v in json.loads(blob).items()
    }
    losses = torch.tensor([steps.get(s, math.nan) for s in range(cfg.steps)])  # steps no member saw: NaN
    flat, identical, max_diff = replicas_identical(comm, trainer.model)
    verdict, outcome = judge(rank, losses, identical, max_diff, cfg.steps)
    if rank == 0:
        write_outputs(
            cfg,
            world,
            flat,
            corpus,
            {
                **outcome,
                **throughput(tokens_per_step, step_times, comm_bytes, train_seconds),
                "metadata": trainer.model.get_model_metadata(),
                "live": live_report(trainer, live_dir, started, finished_at),
            },
        )
    trainer.close()
    return verdict


def wait_for_replacement(membership: Any, world: int, timeout: float = 60.0) -> None:
    """With --kill-at: before the second-to-last step, wait (up to ``timeout`` s) until the launcher's replacement
    has asked to join, so the members admit it at the last step and the final replica check covers the healed
    newcomer. Every worker (the ``world`` first ones) took one join ticket; the replacement takes the next."""
    deadline = time.monotonic() + timeout
    while membership.store.add("joins", 0) <= world and time.monotonic() < deadline:
        time.sleep(0.02)


def describe_generation(event: dict[str, Any]) -> str:
    """One generation event of the live trainer, in words."""
    lost = f", lost member(s) {event['lost']}" if event["lost"] else ""
    reason = event["reason"] if len(event["reason"]) <= 100 else event["reason"][:97] + "..."  # Gloo's are long
    return (
        f"generation {event['generation']}: {event['world']} member(s) at step {event['step']} "
        f"({reason}; state healed: {event['heal']}{lost})"
    )


def live_report(trainer: Any, live_dir: Path, started: float, finished_at: dict[int, float]) -> dict[str, Any]:
    """The live events for metrics.json: this worker's generations, and per --kill-at kill the time from the kill to
    this worker's first step completed in the generation formed without the dead member, and the steps redone
    (applied before the failure and again after it: 0 when the survivors retried only the failed step)."""
    kills = []
    for path in sorted(live_dir.glob("kill-*.json")):
        kill = json.loads(path.read_text())
        if kill["time"] < started:  # left by an earlier run in this folder
            continue
        healed = next((e for e in trainer.events if kill["member"] in e["lost"]), None)
        after = [t for t in finished_at.values() if healed is not None and t > healed["formed"]]
        if after:  # a step completed before the new generation formed may be one the killed worker was past
            kill["kill_to_next_step_s"] = round(min(after) - kill["time"], 3)
            kill["steps_redone"] = max(0, healed["completed_before"] - healed["step"])
        kills.append(kill)
    return {
        "generations": trainer.events,
        "heals": [e["heal"] for e in trainer.events],
        "kills": kills,
        "members": list(trainer.generation.members),
        "final_world": trainer.world_size,
    }


def launch_live(cfg: TrainConfig, world: int, argv: list[str]) -> int:
    """Run this script's ``argv`` as ``world`` live workers: what ``python -m gpudist.live --nproc WORLD
    --replacements K -- python examples/train.py ARGS`` does (this process hosts the membership service)."""
    from gpudist.live import launch

    print(
        f"gpudist {gpudist.__version__}: training TinyLM with elastic --live on {world} worker process(es) for "
        f"{cfg.steps} steps (python -m gpudist.live --nproc {world} --replacements {cfg.replacements} -- "
        f"python examples/train.py {' '.join(argv)})",
        flush=True,
    )
    return launch([sys.executable, str(Path(__file__).resolve()), *argv], world, replacements=cfg.replacements)


def bytes_moved(comm: gpudist.CommunicationBackend, opt: torch.optim.Optimizer) -> int:
    """Bytes this rank has communicated: the backend's count, plus the parameter-server traffic of async SGD."""
    return comm.stats.total_bytes + getattr(opt, "bytes_moved", 0)


def replicas_identical(
    comm: gpudist.CommunicationBackend, model: gpudist.ShardedModel
) -> tuple[torch.Tensor, bool, float]:
    """Gathers the full parameters (collective) and checks bitwise that every rank's equal rank 0's. Returns them,
    the verdict and the largest difference seen."""
    flat = (
        model.gather_full_parameters()
        if isinstance(model, gpudist.ShardedModel)
        else torch.nn.utils.parameters_to_vector(model.parameters()).detach()
    )
    reference = flat.clone()
    comm.broadcast(reference, src=0)
    flags = torch.tensor(
        [float(torch.equal(flat, reference)), -(flat - reference).abs().max().item()], device=flat.device
    )
    comm.all_reduce(flags, "min")  # min of equal-flags: all equal; min of -diff: -(largest difference)
    return flat, bool(flags[0] == 1.0), -float(flags[1])


@torch.no_grad()
def evaluate(net: torch.nn.Module, corpus: SyntheticCorpus, batch: int = 32) -> float:
    """Mean loss on the first VAL_SEQUENCES sequences of the "val" stream, which training never sees."""
    batches = (corpus.batches(i, batch, split="val") for i in range(VAL_SEQUENCES // batch))
    losses = [lm_loss(net(x), y).item() for x, y in batches]
    return sum(losses) / len(losses)


@torch.no_grad()
def generate(net: TinyLM, prompt: list[int], n_tokens: int, seed: int, temperature: float = 0.7) -> list[int]:
    """Samples a continuation of ``prompt``: what the model learned, in words."""
    gen = torch.Generator().manual_seed(seed)
    tokens = list(prompt)
    for _ in range(n_tokens):
        logits = net(torch.tensor([tokens[-net.seq_len :]]))[0, -1]
        tokens.append(int(torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)))
    return tokens


# ---------------------------------------------------------------------------------------------------------------------
# Output: progress, files, summary


class Progress:
    """Rank 0's progress bar: rewritten in place (``\\r``) on a terminal, one line per update otherwise (logs, CI)."""

    def __init__(self, steps: int, tokens_per_step: int, width: int = 24):
        self.steps, self.tokens_per_step, self.width = steps, tokens_per_step, width
        self.tty = sys.stdout.isatty()
        self.started = time.perf_counter()
        self.last_width = 0  # a shorter line must blank the rest of the longer one it overwrites

    def update(self, step: int, loss: float, step_times: list[float], comm_bytes: list[int]) -> None:
        done = int(self.width * step / self.steps)
        elapsed = time.perf_counter() - self.started
        eta = elapsed / step * (self.steps - step)
        line = (
            f"step {step:>{len(str(self.steps))}}/{self.steps} [{'#' * done}{'.' * (self.width - done)}] "
            f"loss {loss:.3f} | {self.tokens_per_step * len(step_times) / sum(step_times) / 1e3:5.1f}k tok/s | "
            f"comm {sum(comm_bytes) / len(comm_bytes) / 2**20:.2f} MiB/step | eta {eta:3.0f}s"
        )
        if self.tty:
            print(f"\r{line.ljust(self.last_width)}", end="", flush=True)
            self.last_width = len(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.tty:
            print(flush=True)


def report(metrics: dict[str, Any], out: Path) -> None:
    cfg = metrics["config"]
    print(
        f"{cfg['strategy']} on {cfg['world_size']} rank(s), {cfg['steps']} steps of {metrics['tokens_per_step']} "
        f"tokens, {metrics['train_seconds']:.1f} s"
    )
    print(
        f"  loss {metrics['initial_loss']:.3f} -> {metrics['final_loss']:.3f} (held-out {metrics['val_loss']:.3f}); "
        f"uniform guess log(vocab) = {metrics['log_vocab']:.3f}, generator's entropy floor = "
        f"{metrics['entropy_floor']:.3f}"
    )
    print(
        f"  {metrics['tokens_per_s'] / 1e3:.1f}k tokens/s, communication "
        f"{metrics['comm_bytes_per_step'] / 2**20:.2f} MiB/step per rank, "
        f"replicas identical: {metrics['replicas_identical']}"
    )
    if metrics.get("compression"):
        c = metrics["compression"]
        print(
            f"  compression {c['compressor']['name']} of {c['compress']} (error feedback: {c['error_feedback']}): "
            "sent "
            f"{c['total']['sent_bytes'] / 2**20:.1f} MiB vs {c['total']['dense_bytes'] / 2**20:.1f} MiB dense "
            f"({100 * c['total']['ratio']:.1f}% over the run, {100 * c['last_step']['ratio']:.1f}% per step after "
            f"{c['warmup_steps']} warm-up steps)"
        )
    print(f"  sample: {metrics['sample']}")
    print(f"  wrote {out / 'metrics.json'}, {out / 'loss.png'}, {out / 'model.safetensors'}")


def plot_loss(metrics: dict[str, Any]) -> bytes:
    """The loss curve as PNG bytes: matplotlib when installed, else a plain raster (same lines, no text)."""
    losses, floor, log_vocab = metrics["loss"], metrics["entropy_floor"], metrics["log_vocab"]
    first = next((i for i, v in enumerate(losses) if not math.isnan(v)), 0)  # a resumed run starts later
    losses = losses[first:]
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        return raster_plot(losses, [(log_vocab, (200, 60, 60)), (floor, (40, 150, 40))])
    cfg = metrics["config"]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot(range(first, first + len(losses)), losses, lw=1.2, label="training loss (global batch)")
    ax.axhline(log_vocab, color="tab:red", ls="--", lw=1, label=f"log(vocab) = {log_vocab:.2f}")
    ax.axhline(floor, color="tab:green", ls="--", lw=1, label=f"entropy floor = {floor:.2f}")
    ax.set(
        xlabel="step",
        ylabel="cross-entropy (nats)",
        ylim=(0, max(max(losses), log_vocab) * 1.05),
        title=f"TinyLM, {cfg['strategy']} on {cfg['world_size']} rank(s), comm {cfg['comm_dtype']}",
    )
    ax.legend()
    ax.grid(alpha=0.3)
    buf = io.BytesIO()
    fig.savefig(buf, format="png", bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def raster_plot(
    values: list[float],
    hlines: list[tuple[float, tuple[int, int, int]]],
    width: int = 640,
    height: int = 360,
    margin: int = 30,
) -> bytes:
    """A line plot as PNG bytes without matplotlib: y from 0 (bottom) up, a light grid line at every whole
    number, dashed ``hlines`` in their colours and ``values`` in blue."""
    pixels = bytearray(b"\xff" * (width * height * 3))
    top = max([*values, *(v for v, _ in hlines)]) * 1.05 or 1.0

    def put(x: int, y: int, rgb: tuple[int, int, int]) -> None:
        if 0 <= x < width and 0 <= y < height:
            pixels[(y * width + x) * 3 : (y * width + x) * 3 + 3] = bytes(rgb)

    def to_y(v: float) -> int:
        return round(height - margin - v / top * (height - 2 * margin))

    for whole in range(math.ceil(top)):
        for x in range(margin, width - margin):
            put(x, to_y(whole), (225, 225, 225))
    for value, rgb in hlines:
        for x in range(margin, width - margin):
            if (x // 6) % 2 == 0:
                put(x, to_y(value), rgb)
    for x in range(margin, width - margin + 1):  # frame
        put(x, margin, (120, 120, 120))
        put(x, height - margin, (120, 120, 120))
    for y in range(margin, height - margin + 1):
        put(margin, y, (120, 120, 120))
        put(width - margin, y, (120, 120, 120))
    points = [(margin + i / max(1, len(values) - 1) * (width - 2 * margin), to_y(v)) for i, v in enumerate(values)]
    for (x0, y0), (x1, y1) in zip(points, [*points[1:], points[-1]], strict=True):
        n = int(max(abs(x1 - x0), abs(y1 - y0))) + 1
        for k in range(n + 1):  # sample the segment densely; 2 px thick
            x, y = round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n)
            put(x, y, (30, 90, 200))
            put(x, y + 1, (30, 90, 200))
    return encode_png(width, height, bytes(pixels))


def encode_png(width: int, height: int, rgb: bytes) -> bytes:
    """8-bit RGB pixels (row-major) -> PNG bytes: signature, IHDR, one zlib IDAT (filter 0 per row), IEND."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    stride = width * 3
    raw = b"".join(b"\x00" + rgb[y * stride : (y + 1) * stride] for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8 bits, truecolour, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b"")


# ---------------------------------------------------------------------------------------------------------------------
# Command line


def parse_args(argv: list[str] | None = None) -> tuple[TrainConfig, int | None]:
    defaults = TrainConfig()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--strategy",
        default=defaults.strategy,
        help=f"one of {', '.join(STRATEGIES)} (those gpudist implements now: "
        f"{', '.join(available_strategies()) or 'none'})",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        default=2,
        help="local Gloo ranks to spawn (ignored under torchrun/mpirun, which set the world size)",
    )
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument(
        "--global-batch",
        type=int,
        default=defaults.global_batch,
        help="sequences per step over all ranks; a multiple of the world size",
    )
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed, help="model initialisation and corpus")
    parser.add_argument(
        "--comm-dtype",
        choices=list(COMM_DTYPES),
        default=defaults.comm_dtype,
        help="dtype gradients travel in (bf16 halves the bytes)",
    )
    parser.add_argument(
        "--optimizer",
        choices=["adamw", "sgd"],
        default=defaults.optimizer,
        help="inner optimizer: adamw (default) or momentum sgd (try --lr 0.03)",
    )
    parser.add_argument(
        "--compression",
        default=None,
        help="compress gradients: topk:RATIO (e.g. topk:0.01), int8, 1bit (ddp, zero1, zero2)",
    )
    parser.add_argument(
        "--compression-warmup",
        type=int,
        default=defaults.compression_warmup,
        help="uncompressed steps before compression starts",
    )
    parser.add_argument(
        "--no-error-feedback",
        action="store_true",
        help="drop what compression loses instead of sending it later (for comparison)",
    )
    parser.add_argument(
        "--pp",
        type=int,
        default=defaults.pp,
        help="pipeline stages for --strategy pipeline (the rest of the world is data parallel)",
    )
    parser.add_argument(
        "--tp",
        type=int,
        default=defaults.tp,
        help="tensor-parallel ranks for --strategy tensor and hybrid (must divide the heads and vocab)",
    )
    parser.add_argument(
        "--micro-batches",
        type=int,
        default=defaults.micro_batches,
        help="micro-batches per step for --strategy pipeline",
    )
    parser.add_argument(
        "--compress-momentum",
        action="store_true",
        help="communicate the momentum instead of the gradient (with --optimizer sgd and --strategy "
        "ddp; 1-bit converges with it)",
    )
    parser.add_argument(
        "--max-staleness",
        type=int,
        default=defaults.max_staleness,
        help="--strategy async: versions a gradient may lag behind (0 = synchronous SGD)",
    )
    parser.add_argument(
        "--checkpoint-every",
        type=int,
        default=defaults.checkpoint_every,
        help="--strategy elastic: steps between checkpoints (saved under OUT/checkpoints)",
    )
    parser.add_argument(
        "--live",
        action="store_true",
        help="--strategy elastic without restarts: --world-size gpudist.live workers (this process hosts the "
        "membership service); survivors of a death retry the step in-process, replacements heal from a peer",
    )
    parser.add_argument(
        "--zero-stage",
        type=int,
        choices=[0, 1, 2, 3],
        default=defaults.zero_stage,
        help="--live: 0 (DDP), or shard the optimizer state (1), gradients (2) and parameters (3)",
    )
    parser.add_argument(
        "--redundancy",
        choices=["buddy"],
        default=None,
        help="--live with --zero-stage 1|2|3: mirror each rank's shard on the next rank, so a death heals from memory",
    )
    parser.add_argument(
        "--kill-at",
        type=int,
        default=None,
        help="--live, a demo of a failure: the last worker SIGKILLs itself in step KILL_AT; the job goes on",
    )
    parser.add_argument(
        "--replacements",
        type=int,
        default=defaults.replacements,
        help="--live: workers to start in place of ones that die",
    )
    parser.add_argument(
        "--out",
        help="output folder (default: runs/<strategy>-w<world size>; runs/elastic for "
        "--strategy elastic, which resumes from its checkpoints there; runs/elastic-live with --live)",
    )
    parser.add_argument("--log-every", type=int, default=defaults.log_every, help="steps between progress updates")
    args = parser.parse_args(argv)

    if args.strategy not in STRATEGIES:
        planned = [s for s in STRATEGIES if s not in available_strategies()]
        parser.error(
            f"unknown strategy {args.strategy!r}; strategies that work: {', '.join(available_strategies())}"
            + (f" (planned: {', '.join(planned)})" if planned else "")
        )
    if args.strategy not in available_strategies():
        model_cls, optim_cls = STRATEGIES[args.strategy]
        parser.error(
            f"strategy {args.strategy!r} needs gpudist.{model_cls} and gpudist.{optim_cls}, which gpudist "
            f"{gpudist.__version__} does not have yet; strategies that work: "
            f"{', '.join(available_strategies())}"
        )
    launched = any(var in os.environ for var in LAUNCHER_RANK_VARS)
    world = detect_environment().world_size if launched else args.world_size
    for name, value in [("--world-size", world), ("--steps", args.steps), ("--log-every", args.log_every)]:
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.global_batch < world or args.global_batch % world:
        parser.error(
            f"--global-batch {args.global_batch} must be a positive multiple of the world size {world}, "
            f"so every rank gets an equal slice"
        )
    if args.max_staleness < 0 or args.checkpoint_every < 1:
        parser.error(
            f"--max-staleness must be >= 0 and --checkpoint-every >= 1, got {args.max_staleness} and "
            f"{args.checkpoint_every}"
        )
    live_options = args.zero_stage or args.redundancy or args.kill_at is not None
    if (args.live and args.strategy != "elastic") or (live_options and not args.live):
        parser.error("--live goes with --strategy elastic; --zero-stage, --redundancy and --kill-at with --live")
    if args.redundancy and not args.zero_stage:
        parser.error("--redundancy buddy mirrors sharded state: add --zero-stage 1, 2 or 3")
    if args.kill_at is not None and (world < 2 or not 0 <= args.kill_at <= args.steps - 3):
        parser.error(
            f"--kill-at {args.kill_at} needs --world-size >= 2 (got {world}) and a step in 0..{args.steps - 3} "
            "(--steps - 3: the replacement is admitted before the last step)"
        )
    if args.replacements < 0:
        parser.error(f"--replacements must be >= 0, got {args.replacements}")
    if not args.lr > 0:
        parser.error(f"--lr must be positive, got {args.lr}")
    if args.compression is not None:
        try:
            gpudist.compression.parse_compressor(args.compression)
        except ValueError as e:
            parser.error(f"--compression: {e}")
        if args.strategy not in ("ddp", "zero1", "zero2"):
            parser.error(
                f"--compression works with --strategy ddp, zero1 or zero2, not {args.strategy!r} (ZeRO-3 "
                "gathers parameters, which have no error feedback to absorb compression)"
            )
        if args.compression_warmup < 0:
            parser.error(f"--compression-warmup must be >= 0, got {args.compression_warmup}")
    pp = args.pp if args.strategy in ("pipeline", "hybrid") else 1
    tp = args.tp if args.strategy in ("tensor", "hybrid") else 1
    if args.strategy in ("tensor", "hybrid"):
        for what, size in [("heads per block", defaults.n_heads), ("vocabulary", SyntheticCorpus.vocab_size)]:
            if args.tp < 1 or size % args.tp:
                parser.error(f"--tp {args.tp} must divide TinyLM's {what} ({size})")
    if args.strategy in ("pipeline", "tensor", "hybrid") and world % (pp * tp):
        parser.error(
            f"--pp {pp} x --tp {tp} = {pp * tp} must divide the world size {world} (the ranks left over "
            "are data-parallel replicas)"
        )
    if args.strategy in ("pipeline", "hybrid"):
        if args.pp > defaults.n_layers + 2:
            parser.error(
                f"--pp {args.pp} is more than TinyLM's {defaults.n_layers + 2} pipeline blocks (embeddings, "
                f"{defaults.n_layers} transformer blocks, head)"
            )
        replicas = world // (pp * tp)
        replica_batch = args.global_batch // replicas
        if args.micro_batches < 1 or args.global_batch % replicas or replica_batch % args.micro_batches:
            parser.error(
                f"--micro-batches {args.micro_batches} must divide each replica's batch of {replica_batch} "
                f"sequences (--global-batch {args.global_batch} over {replicas} replicas)"
            )
    if args.compress_momentum and (args.compression is None or args.optimizer != "sgd" or args.strategy != "ddp"):
        parser.error(
            "--compress-momentum needs --compression, --optimizer sgd and --strategy ddp (momentum "
            "compression keeps the full momentum on every rank)"
        )
    suffix = f"-{args.compression.replace(':', '')}" if args.compression else ""
    cfg = TrainConfig(
        strategy=args.strategy,
        steps=args.steps,
        global_batch=args.global_batch,
        lr=args.lr,
        seed=args.seed,
        comm_dtype=args.comm_dtype,
        log_every=args.log_every,
        optimizer=args.optimizer,
        compression=args.compression,
        compression_warmup=args.compression_warmup,
        error_feedback=not args.no_error_feedback,
        compress_momentum=args.compress_momentum,
        pp=args.pp,
        tp=args.tp,
        micro_batches=args.micro_batches,
        max_staleness=args.max_staleness,
        checkpoint_every=args.checkpoint_every,
        live=args.live,
        zero_stage=args.zero_stage,
        redundancy=args.redundancy,
        kill_at=args.kill_at,
        replacements=args.replacements,
        # elastic resumes from its folder's checkpoints, so its folder must not depend on the world size
        out=args.out or default_out(args.strategy, suffix, world, args.live),
    )
    return cfg, None if launched else world


def default_out(strategy: str, suffix: str, world: int, live: bool) -> str:
    """runs/<strategy>[-<compression>]-w<world>; elastic resumes from its folder's checkpoints, so its folder must
    not depend on the world size."""
    if strategy == "elastic":
        return "runs/elastic-live" if live else f"runs/elastic{suffix}"
    return f"runs/{strategy}{suffix}-w{world}"


def run_job(job, cfg, spawn_world: int | None, what: str) -> int:
    """Run ``job(comm, cfg)`` as this process's rank (``spawn_world`` None: under torchrun/mpirun) or on
    ``spawn_world`` spawned local Gloo ranks, report a failed verdict, and return the exit code (0: ok)."""
    if spawn_world is None:  # one rank of a torchrun/mpirun job
        verdict = job(gpudist.init(timeout=OP_TIMEOUT), cfg)
    else:
        print(
            f"gpudist {gpudist.__version__}: training {what} with {cfg.strategy} on {spawn_world} local Gloo "
            f"rank(s) for {cfg.steps} steps",
            flush=True,
        )
        with WorkerPool(spawn_world, timeout=OP_TIMEOUT) as pool:
            # A week for the whole run (a long --steps is fine; poll() takes at most ~24 days), while each
            # collective stays bounded by OP_TIMEOUT, so a hung rank still fails fast.
            verdict = min(pool.run(job, cfg, call_timeout=7 * 24 * 3600.0), key=lambda v: v["ok"])
    return 0 if verdict["ok"] else report_failure(verdict)


def report_failure(verdict: dict[str, Any]) -> int:
    print(
        f"FAILED on rank {verdict['rank']}: replicas identical: {verdict['replicas_identical']}, "
        f"loss decreased: {verdict['loss_decreased']}",
        file=sys.stderr,
    )
    return 1


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cfg, spawn_world = parse_args(argv)
    if cfg.live:
        from gpudist.live import STORE_ENV

        if STORE_ENV not in os.environ:  # the user's command: host the membership service, start the workers
            return launch_live(cfg, spawn_world, argv)
        verdict = train_live(cfg, spawn_world)  # one worker, started by the launcher
        return 0 if verdict is None or verdict["ok"] else report_failure(verdict)
    return run_job(train, cfg, spawn_world, "TinyLM")


if __name__ == "__main__":
    raise SystemExit(main())
