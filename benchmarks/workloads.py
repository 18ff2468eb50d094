"""The models every strategy benchmark trains: ``gpudist.bench.workloads`` (in the package, because the installed
``gpudist bench gpu`` trains them too), re-exported here so that ``benchmarks.workloads`` keeps working."""

from gpudist.bench.workloads import GPT, WORKLOADS, Block, GPTConfig, batch, describe, loss, make, mlp

__all__ = ["GPT", "WORKLOADS", "Block", "GPTConfig", "batch", "describe", "loss", "make", "mlp"]
