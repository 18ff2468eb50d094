"""Backends the multi-rank tests run on: in-memory and Gloo always, MPI when ``mpirun`` and ``mpi4py`` exist."""

from __future__ import annotations

import pytest

from gpudist.testing import mpi_unavailable

MPI = pytest.param(
    "mpi",
    marks=(pytest.mark.mpi, pytest.mark.skipif(mpi_unavailable() is not None, reason=f"MPI: {mpi_unavailable()}")),
)
"""The ``mpi`` backend as a parameter: marked ``mpi``, skipped with the reason when mpirun or mpi4py is missing."""

ALL = ["inmemory", "gloo", MPI]

ALL_MPI_SLOW = ["inmemory", "gloo", pytest.param("mpi", marks=(*MPI.marks, pytest.mark.slow))]
""":data:`ALL` with the MPI case in the slow tier (an mpirun of its own, seconds, for code above the transport)."""

ALL_FAST_INMEMORY = [
    "inmemory",
    pytest.param("gloo", marks=pytest.mark.slow),
    pytest.param("mpi", marks=(*MPI.marks, pytest.mark.slow)),
]
""":data:`ALL` with the Gloo and MPI cases in the slow tier (which CI also runs): for tests whose failure path is
the same code on every transport above the wait, and whose Gloo and MPI cases wait seconds for a timeout or a
process to die."""


def mpi_world(world: int, slow: bool = False):
    """``("mpi", world)`` as a (backend, world) parameter pair, marked and skipped like :data:`MPI` (and marked
    ``slow`` with ``slow``: the slow tier, which CI also runs)."""
    return pytest.param("mpi", world, marks=(*MPI.marks, *([pytest.mark.slow] if slow else [])), id=f"mpi-{world}")
