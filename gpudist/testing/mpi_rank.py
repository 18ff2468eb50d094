"""``python -m gpudist.testing.mpi_rank JOB``: one rank of a :func:`gpudist.testing.run_ranks` job under mpirun."""

import sys

from . import _mpi_rank_main

if __name__ == "__main__":
    _mpi_rank_main(sys.argv[1])
