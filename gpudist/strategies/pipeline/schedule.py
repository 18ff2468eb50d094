"""Splitting a model into stages and scheduling micro-batches: pure functions (the tests and the benchmark use
them directly)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["SCHEDULES", "partition_blocks", "schedule_bubble", "stage_schedule"]

SCHEDULES = ("1f1b", "gpipe")


def partition_blocks(costs: Sequence[int], num_stages: int, balance: str | Sequence[int] = "parameters") -> list[int]:
    """Blocks per stage for blocks of the given ``costs`` (parameter counts).

    ``balance="parameters"`` minimises the largest stage's cost over contiguous splits (every stage gets at least
    one block); ``"uniform"`` gives equal block counts (the first stages one more when they do not divide);
    a sequence of block counts is used as given after checking it.
    """
    n = len(costs)
    if num_stages > n:
        raise ValueError(f"num_stages={num_stages} is more than the model's {n} blocks; every stage needs a block")
    if not isinstance(balance, str):
        counts = [int(c) for c in balance]
        if len(counts) != num_stages or sum(counts) != n or min(counts) < 1:
            raise ValueError(
                f"balance={list(balance)} must give {num_stages} block counts >= 1 summing to the model's {n} blocks"
            )
        return counts
    if balance == "uniform":
        return [n // num_stages + (1 if s < n % num_stages else 0) for s in range(num_stages)]
    if balance != "parameters":
        raise ValueError(f"balance={balance!r}; use 'parameters', 'uniform' or a list of blocks per stage")
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    # best[k][i]: the smallest possible largest stage when the first i blocks form k stages
    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    counts, i = [], n
    for k in range(num_stages, 0, -1):
        counts.append(i - cut[k][i])
        i = cut[k][i]
    return counts[::-1]


def stage_schedule(schedule: str, num_stages: int, stage: int, micro_batches: int) -> list[tuple[str, int]]:
    """The order in which ``stage`` runs forwards ``("F", m)`` and backwards ``("B", m)``."""
    if schedule == "gpipe":
        return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
    warmup = min(num_stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro_batches - warmup, micro_batches)]


def schedule_bubble(
    orders: Sequence[Sequence[tuple[str, int]]], forward_cost: float = 1.0, backward_cost: float = 2.0
) -> float:
    """Idle fraction of the step when every stage runs ``orders[s]`` with these costs, each op starting as soon as
    its input arrived (``F(s, m)`` after ``F(s-1, m)``, ``B(s, m)`` after ``B(s+1, m)``) and the stage is free.
    For GPipe and 1F1B with equal stages it is ``(p - 1) / (m + p - 1)``."""
    p = len(orders)
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    position = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, m = orders[s][position[s]]
            dep = ("F", s - 1, m) if kind == "F" and s > 0 else ("B", s + 1, m) if kind == "B" and s < p - 1 else None
            if kind == "B" and s == p - 1:
                dep = ("F", s, m)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            clock[s] = done[(kind, s, m)] = start + (forward_cost if kind == "F" else backward_cost)
            position[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("the stage orders deadlock: some op waits for one that never runs")
    makespan = max(clock)
    busy = sum(len(order) for order in orders) / 2 * (forward_cost + backward_cost)
    return 1.0 - busy / (p * makespan)
