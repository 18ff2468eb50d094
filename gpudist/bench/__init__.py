"""What ``gpudist bench`` runs: collective and kernel micro-benchmarks, the one command for a GPU runner (``gpu``:
the GPU tests and every GPU number into one JSON), and the helpers the strategy benchmarks in ``benchmarks/`` share
(the environment record, interleaved timing). Not imported by the library itself."""

from .collectives import environment, interleaved_times, parse_size, run_collectives

__all__ = ["environment", "interleaved_times", "parse_size", "run_collectives"]
