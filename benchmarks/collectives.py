"""gpudist's backends vs their own library's raw calls on the same group, in the same run.

    python -m benchmarks.collectives [--backend gloo|mpi|nccl] [--world-size 2] [--max-bytes 64M]

Baselines: Gloo vs ``torch.distributed`` on the same process group, MPI vs blocking ``mpi4py`` calls on the same
communicator (ranks started by ``mpirun``), NCCL vs ``cupy.cuda.nccl`` calls on the same communicator (one
spawned process per GPU; needs CUDA and CuPy).

Prints the nccl-tests-style table of ``gpudist bench collectives`` and writes
``benchmarks/results/collectives_{backend}_w{N}.json`` with busbw of both, their ratio per size, and a summary of
the overhead at >= 1 MiB with the cross-rank consistency check on (the default) and off (``comm.unchecked()``).
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from gpudist.bench import parse_size, run_collectives
from gpudist.fileio import atomic_write_json

RESULTS = Path(__file__).resolve().parent / "results"


def summarize(rows: list[dict], min_bytes: int = 1 << 20) -> dict:
    big = [r for r in rows if r["bytes"] >= min_bytes and "baseline_s" in r]
    if not big:
        return {}
    overhead = lambda key: 1 - statistics.median(r[key] for r in big)
    return {
        "min_bytes": min_bytes,
        "rows": len(big),
        "median_overhead_checked": overhead("ratio_busbw_vs_baseline"),
        "median_overhead_unchecked": overhead("ratio_busbw_nocheck_vs_baseline"),
        "target_overhead": 0.05,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", default="gloo", choices=["gloo", "mpi", "nccl"])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--min-bytes", default="1K")
    parser.add_argument("--max-bytes", default="64M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default=None, help="JSON path (default benchmarks/results/collectives_B_wN.json)")
    args = parser.parse_args()
    out = Path(args.out) if args.out else RESULTS / f"collectives_{args.backend}_w{args.world_size}.json"
    doc = run_collectives(
        args.backend,
        args.world_size,
        json_path=None,
        min_bytes=parse_size(args.min_bytes),
        max_bytes=parse_size(args.max_bytes),
        rounds=args.rounds,
    )
    doc["summary"] = summarize(doc["rows"])
    s = doc["summary"]
    if s:
        print(
            f"# overhead vs {doc['baseline']} at >= 1 MiB (median of {s['rows']} rows): "
            f"checked {s['median_overhead_checked']:+.1%}, unchecked {s['median_overhead_unchecked']:+.1%} "
            f"(target < 5%)"
        )
    print(f"# wrote {atomic_write_json(out, doc)}")


if __name__ == "__main__":
    main()
