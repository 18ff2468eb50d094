"""The ``gpudist plan`` command: its options (:func:`add_arguments`) and what it prints (:func:`run_from_args`);
``gpudist/cli.py`` dispatches to them."""

from __future__ import annotations

import json
from dataclasses import replace

from .model import ATTENTION_KINDS, CHECKPOINTING_MODES, PRESETS, Cluster, ModelSpec, _parse_bytes
from .search import plan


def add_arguments(parser) -> None:
    """``gpudist plan``'s options."""
    parser.add_argument("--model", required=True, help=f"a preset ({', '.join(PRESETS)}) or a JSON file of sizes")
    parser.add_argument("--layers", type=int)
    parser.add_argument("--hidden", type=int)
    parser.add_argument("--heads", type=int)
    parser.add_argument("--kv-heads", type=int)
    parser.add_argument("--ffn", type=int)
    parser.add_argument("--vocab", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--global-batch", type=int, default=None, help="sequences per step (default: 4 per device)")
    parser.add_argument("--nodes", type=int, default=1)
    parser.add_argument("--gpus-per-node", type=int, default=8)
    parser.add_argument("--gpu-memory", default="80GB")
    parser.add_argument("--tflops", type=float, default=None, help="achieved TFLOP/s per device (default 400)")
    parser.add_argument("--intra-bw", type=float, default=None, help="GB/s per rank inside a node (default 150)")
    parser.add_argument("--inter-bw", type=float, default=None, help="GB/s per rank across nodes (default 25)")
    parser.add_argument("--intra-latency-us", type=float, default=None)
    parser.add_argument("--inter-latency-us", type=float, default=None)
    parser.add_argument("--measure", action="store_true", help="calibrate links and compute on this machine")
    parser.add_argument("--dtype", default="bf16", choices=["fp32", "bf16", "fp16"], help="parameter dtype")
    parser.add_argument("--no-mixed-precision", action="store_true", help="activations in the parameter dtype")
    parser.add_argument("--optimizer", default="adam", choices=["adam", "adamw", "sgd", "sgd-plain"])
    parser.add_argument(
        "--checkpointing",
        nargs="?",
        const="full",
        default="auto",
        choices=["auto", *CHECKPOINTING_MODES],
        help="activation checkpointing: auto (default) searches none, selective and full for every layout; a mode "
        "forces it; the bare flag means full",
    )
    parser.add_argument(
        "--attention",
        default="flash",
        choices=ATTENTION_KINDS,
        help="flash (default: a fused attention keeps no scores) or eager (scores kept: selective checkpointing "
        "recomputes them)",
    )
    parser.add_argument("--top", type=int, default=12, help="rows of feasible configurations to print")
    parser.add_argument("--json", default=None, help="also write every configuration to this JSON file")


def run_from_args(args) -> int:
    """``gpudist plan``: print the ranked table and the code and command of the best configuration."""
    import sys
    from pathlib import Path

    if args.model in PRESETS:
        sizes = dict(PRESETS[args.model])
        name = args.model
    elif Path(args.model).is_file():
        sizes = json.loads(Path(args.model).read_text())
        name = Path(args.model).stem
    elif all(getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")):
        sizes, name = {}, args.model
    else:
        print(
            f"gpudist plan: --model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor a JSON file; "
            "or give --layers, --hidden, --heads, --vocab (and --seq-len)",
            file=sys.stderr,
        )
        return 2
    for key in ("layers", "hidden", "heads", "kv_heads", "ffn", "vocab", "seq_len"):
        if getattr(args, key) is not None:
            sizes[key] = getattr(args, key)
    sizes.setdefault("seq_len", 2048)
    sizes["attention"] = args.attention
    try:
        spec = ModelSpec.from_sizes(name=name, **sizes)
    except TypeError as e:
        print(f"gpudist plan: bad model sizes ({e})", file=sys.stderr)
        return 2
    base = Cluster(nodes=args.nodes, devices_per_node=args.gpus_per_node, device_memory=_parse_bytes(args.gpu_memory))
    overrides = {
        "device_flops": args.tflops and args.tflops * 1e12,
        "intra_bandwidth": args.intra_bw and args.intra_bw * 1e9,
        "inter_bandwidth": args.inter_bw and args.inter_bw * 1e9,
        "intra_latency": args.intra_latency_us and args.intra_latency_us * 1e-6,
        "inter_latency": args.inter_latency_us and args.inter_latency_us * 1e-6,
    }
    cluster = replace(base, **{k: v for k, v in overrides.items() if v})
    batch = args.global_batch or 4 * cluster.world_size
    result = plan(
        spec,
        global_batch=batch,
        cluster=cluster,
        dtype=args.dtype,
        mixed_precision=not args.no_mixed_precision,
        optimizer=args.optimizer,
        checkpointing=args.checkpointing,
        measure=args.measure,
    )
    print(result.table(top=args.top))
    print()
    if result.best is None:
        if args.checkpointing == "auto":
            print("nothing fits, even with full activation checkpointing: try more nodes or a smaller --global-batch")
        else:
            print(
                f"nothing fits with --checkpointing {args.checkpointing}: try --checkpointing auto, more nodes or a "
                "smaller --global-batch"
            )
    else:
        print(f"best: {result.best.config.describe()}  ({result.best.step_time:.3f} s/step predicted)")
        print(result.code())
        print(result.command())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_json(), indent=1))
        print(f"wrote {args.json}")
    return 0
