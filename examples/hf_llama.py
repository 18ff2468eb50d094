"""Train a tiny Hugging Face Llama (built from a config: nothing is downloaded) with a gpudist strategy.

Standalone, it spawns N local Gloo ranks on the CPU:

    python examples/hf_llama.py --strategy zero3 --world-size 2
    python examples/hf_llama.py --strategy pipeline --world-size 2 --data random

Under a launcher each process is one rank (the same code path):

    torchrun --nproc-per-node 2 examples/hf_llama.py --strategy fsdp

Needs ``transformers`` (``pip install -e ".[hf]"``). The model is the library's own ``LlamaForCausalLM``, wrapped as
it is: data-parallel strategies call ``model(input_ids=..., labels=...)`` and backpropagate its ``.loss``; the
pipeline splits ``model.model.layers`` over the stages with no user wrappers (embeddings and rotary embeddings on the
first stage, the final norm and head on the last). Tokens come from examples/lm.py's generated corpus (``--data
corpus``: a grammar the model learns, with a known entropy floor) or are uniformly random (``--data random``: nothing
to learn; the loss stays near log(vocab)). The progress line and the loss plot are examples/train.py's; rank 0 writes
OUT/metrics.json and OUT/loss.png. The exit code is 0 when every replica holds the same parameters and, on the
corpus, the loss went down.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

import gpudist
from gpudist.bench import environment
from gpudist.fileio import atomic_write_bytes
from gpudist.launch import detect_environment

try:  # imported once, here: transformers' lazy module is not safe to first import from several rank threads at once
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:  # main() says what to install
    LlamaConfig = LlamaForCausalLM = None

if __package__:  # imported as examples.hf_llama (the tests)
    from . import train
    from .lm import SyntheticCorpus
else:  # run as a script: its own folder is on sys.path
    import train
    from lm import SyntheticCorpus

STRATEGIES = {name: train.STRATEGIES[name] for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "pipeline")}
"""The strategies this script runs (model class, optimizer class), as examples/train.py names them."""
DATA = ("corpus", "random")
_BUILD_LOCK = threading.Lock()


@dataclasses.dataclass(frozen=True)
class LlamaRun:
    """One training run of the tiny Llama."""

    strategy: str = "ddp"
    steps: int = 200
    global_batch: int = 16
    """Sequences per step over all ranks (each data-parallel replica takes its equal slice)."""
    seq_len: int = 32
    lr: float = 3e-3
    seed: int = 0
    data: str = "corpus"
    """"corpus" (examples/lm.py's generated sentences, vocabulary 64) or "random" (uniform tokens)."""
    vocab: int = 64
    """Vocabulary of --data random (the corpus fixes its own)."""
    hidden: int = 64
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    """Key/value heads: fewer than ``heads`` is grouped-query attention."""
    pp: int = 2
    """Pipeline stages (--strategy pipeline); the ranks left over are data-parallel replicas."""
    micro_batches: int = 4
    """Micro-batches per step and replica (--strategy pipeline)."""
    out: str = "runs/hf-llama"
    log_every: int = 10
    comm_dtype: str = "fp32"
    """Kept for examples/train.py's plot title."""


def vocab_size(cfg: LlamaRun) -> int:
    return SyntheticCorpus.vocab_size if cfg.data == "corpus" else cfg.vocab


def make_llama(cfg: LlamaRun) -> torch.nn.Module:
    """``LlamaForCausalLM`` from a config, the same on every rank (seeded, global RNG left as it was; one at a time,
    since rank threads of the in-memory backend share torch's global generator)."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    config = LlamaConfig(
        vocab_size=vocab_size(cfg),
        hidden_size=cfg.hidden,
        intermediate_size=2 * cfg.hidden,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        max_position_embeddings=cfg.seq_len,
        tie_word_embeddings=True,
    )
    with _BUILD_LOCK, torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return LlamaForCausalLM(config)


def token_batch(cfg: LlamaRun, step: int, rank: int, world: int) -> torch.Tensor:
    """This replica's slice of step ``step``'s global batch of input ids (also the labels: the model shifts them)."""
    if cfg.data == "corpus":
        return SyntheticCorpus(cfg.seed, cfg.seq_len).batches(step, cfg.global_batch, rank, world)[0]
    g = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
    tokens = torch.randint(0, cfg.vocab, (cfg.global_batch, cfg.seq_len), generator=g)
    per = cfg.global_batch // world
    return tokens[rank * per : (rank + 1) * per]


def train_llama(comm: gpudist.CommunicationBackend, cfg: LlamaRun) -> dict[str, Any]:
    """Runs ``cfg`` on this rank; rank 0 writes the outputs. Returns this rank's verdict."""
    rank, world = comm.rank, comm.world_size
    model_cls, optim_cls = (getattr(gpudist, name) for name in STRATEGIES[cfg.strategy])
    device = comm.device
    config = gpudist.ShardingConfiguration(comm)
    net = make_llama(cfg).to(device)
    pipeline = cfg.strategy == "pipeline"
    if pipeline:  # the model as it is: the adapter finds model.model.layers and the glue around them
        model = model_cls(net, config, num_stages=cfg.pp, micro_batches=cfg.micro_batches)
        data_rank, data_size = model.data_parallel_rank, model.data_parallel_size
    else:
        model = model_cls(net, config)
        data_rank, data_size = rank, world
    opt = optim_cls(train.make_optimizer(model.parameters(), cfg.lr), config)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: train.lr_factor(s, steps=cfg.steps))
    tokens_per_step = cfg.global_batch * cfg.seq_len
    progress = train.Progress(cfg.steps, tokens_per_step) if rank == 0 else None

    losses = torch.zeros(cfg.steps)
    step_times, comm_bytes = [], []
    window_start, started = 0, time.perf_counter()
    for step in range(cfg.steps):
        t0, bytes0 = time.perf_counter(), train.bytes_moved(comm, opt)
        ids = token_batch(cfg, step, data_rank, data_size).to(device)
        if pipeline:
            losses[step] = model.train_step(ids, ids, None, opt)  # labels = input ids; loss_fn None: the model's
        else:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[step] = loss.item()
        schedule.step()
        step_times.append(time.perf_counter() - t0)
        comm_bytes.append(model.last_step_bytes if pipeline else train.bytes_moved(comm, opt) - bytes0)
        if (step + 1) % cfg.log_every == 0 or step + 1 == cfg.steps:
            window = losses[window_start : step + 1].mean().reshape(1).to(device)
            comm.all_reduce(window, "average")
            if progress is not None:
                progress.update(step + 1, float(window), step_times[window_start:], comm_bytes[window_start:])
            window_start = step + 1
    train_seconds = time.perf_counter() - started
    if progress is not None:
        progress.close()

    losses = losses.to(device)
    comm.all_reduce(losses, "average")  # equal slices: the mean of the replicas' means is the global batch's
    losses = losses.cpu()
    _, identical, max_diff = train.replicas_identical(comm, model)
    tail = max(1, cfg.steps // 10)
    initial, final = float(losses[0]), float(losses[-tail:].mean())
    decreased = final < initial
    verdict = {"rank": rank, "replicas_identical": identical, "loss_decreased": decreased}
    verdict["ok"] = identical and (decreased or cfg.data == "random")
    if rank != 0:
        return verdict
    log_vocab = math.log(vocab_size(cfg))
    measured = step_times[1:] or step_times
    metrics = {
        "config": dataclasses.asdict(cfg) | {"world_size": world},
        "model": "LlamaForCausalLM",
        "parameter_count": model.parameter_count(),
        "tokens_per_step": tokens_per_step,
        "loss": [round(v, 6) for v in losses.tolist()],
        "step_time_s": [round(t, 6) for t in step_times],
        "comm_bytes": comm_bytes,
        "initial_loss": initial,
        "final_loss": final,
        "log_vocab": log_vocab,
        "entropy_floor": SyntheticCorpus(cfg.seed, cfg.seq_len).entropy_floor(64, split="val")
        if cfg.data == "corpus"
        else log_vocab,
        "tokens_per_s": tokens_per_step * len(measured) / sum(measured),
        "comm_bytes_per_step": sorted(comm_bytes)[len(comm_bytes) // 2],
        "train_seconds": train_seconds,
        "loss_decreased": decreased,
        "replicas_identical": identical,
        "replica_max_abs_diff": max_diff,
        "metadata": model.get_model_metadata(),
        "environment": environment(),
    }
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(out / "metrics.json", json.dumps(metrics, indent=1, default=str).encode())
    atomic_write_bytes(out / "loss.png", train.plot_loss(metrics))
    print(
        f"{cfg.strategy} on {world} rank(s), {cfg.steps} steps of {tokens_per_step} tokens ({cfg.data}), "
        f"{train_seconds:.1f} s: loss {initial:.3f} -> {final:.3f} (log(vocab) {log_vocab:.3f}, floor "
        f"{metrics['entropy_floor']:.3f}); replicas identical: {identical}\n"
        f"  wrote {out / 'metrics.json'}, {out / 'loss.png'}",
        flush=True,
    )
    return verdict


def parse_args(argv: list[str] | None = None) -> tuple[LlamaRun, int | None]:
    defaults = LlamaRun()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategy", choices=list(STRATEGIES), default=defaults.strategy)
    parser.add_argument("--world-size", type=int, default=2, help="local Gloo ranks to spawn (not under torchrun)")
    parser.add_argument("--steps", type=int, default=defaults.steps)
    parser.add_argument("--global-batch", type=int, default=defaults.global_batch)
    parser.add_argument("--seq-len", type=int, default=defaults.seq_len)
    parser.add_argument("--lr", type=float, default=defaults.lr)
    parser.add_argument("--seed", type=int, default=defaults.seed)
    parser.add_argument("--data", choices=DATA, default=defaults.data, help="generated corpus or random tokens")
    parser.add_argument("--layers", type=int, default=defaults.layers)
    parser.add_argument("--pp", type=int, default=defaults.pp, help="pipeline stages (--strategy pipeline)")
    parser.add_argument("--micro-batches", type=int, default=defaults.micro_batches)
    parser.add_argument("--log-every", type=int, default=defaults.log_every)
    parser.add_argument("--out", help="output folder (default: runs/hf-llama-<strategy>-w<world size>)")
    args = parser.parse_args(argv)
    launched = any(var in os.environ for var in train.LAUNCHER_RANK_VARS)
    world = detect_environment().world_size if launched else args.world_size
    for name, value in [("--world-size", world), ("--steps", args.steps), ("--log-every", args.log_every)]:
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    pp = args.pp if args.strategy == "pipeline" else 1
    if pp < 1 or world % pp or pp > args.layers:
        parser.error(f"--pp {pp} must divide the world size {world} and be at most --layers {args.layers}")
    replicas = world // pp
    per_replica = args.global_batch // replicas
    if args.global_batch % replicas or per_replica < 1 or (pp > 1 and per_replica % args.micro_batches):
        parser.error(
            f"--global-batch {args.global_batch} must split evenly over {replicas} replica(s)"
            + (f" into --micro-batches {args.micro_batches}" if pp > 1 else "")
        )
    cfg = LlamaRun(
        strategy=args.strategy,
        steps=args.steps,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        lr=args.lr,
        seed=args.seed,
        data=args.data,
        layers=args.layers,
        pp=args.pp,
        micro_batches=args.micro_batches,
        log_every=args.log_every,
        out=args.out or f"runs/hf-llama-{args.strategy}-w{world}",
    )
    return cfg, None if launched else world


def main(argv: list[str] | None = None) -> int:
    cfg, spawn_world = parse_args(argv)
    if LlamaForCausalLM is None:
        print('examples/hf_llama.py needs transformers: pip install -e ".[hf]"', file=sys.stderr)
        return 2
    return train.run_job(train_llama, cfg, spawn_world, "a tiny LlamaForCausalLM")


if __name__ == "__main__":
    raise SystemExit(main())
