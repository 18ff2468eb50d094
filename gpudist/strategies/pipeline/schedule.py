"""Splitting a model into stages and scheduling micro-batches: pure functions (the tests and the benchmark use
them directly)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "INTERLEAVED",
    "SCHEDULES",
    "check_interleaved",
    "interleaved_warmup",
    "partition_blocks",
    "schedule_bubble",
    "stage_schedule",
]

SCHEDULES = ("1f1b", "gpipe")
INTERLEAVED = "interleaved"
"""Interleaved 1F1B: ``v`` virtual stages (chunks) per rank. Not in :data:`SCHEDULES`, which the planner and
HybridShardedModel enumerate and do not model yet."""


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


def check_interleaved(num_stages: int, micro_batches: int, virtual_stages: int) -> None:
    """Refuse interleaved settings Megatron-LM refuses too, naming the fix.

    Raises:
        ValueError: When ``virtual_stages`` is not an int >= 2, ``num_stages`` < 2, or ``micro_batches`` is not a
            multiple of ``num_stages`` (the rounds of ``p`` micro-batches per chunk would not line up).
    """
    if isinstance(virtual_stages, bool) or not isinstance(virtual_stages, int) or virtual_stages < 2:
        raise ValueError(f"virtual_stages={virtual_stages!r} must be an int >= 2 for schedule='interleaved'")
    if num_stages < 2:
        raise ValueError(f"schedule='interleaved' needs num_stages >= 2, got {num_stages}; use '1f1b'")
    if micro_batches % num_stages:
        raise ValueError(
            f"schedule='interleaved' needs micro_batches a multiple of num_stages={num_stages}, got "
            f"micro_batches={micro_batches}; use {num_stages * max(1, round(micro_batches / num_stages))}"
        )


def interleaved_warmup(num_stages: int, stage: int, micro_batches: int, virtual_stages: int) -> int:
    """Forwards ``stage`` runs before its first backward in interleaved 1F1B (Megatron-LM's count); the rest
    alternate forward and backward until the forwards run out."""
    return min(2 * (num_stages - stage - 1) + (virtual_stages - 1) * num_stages, micro_batches * virtual_stages)


def stage_schedule(
    schedule: str, num_stages: int, stage: int, micro_batches: int, virtual_stages: int = 1
) -> list[tuple]:
    """The order in which ``stage`` runs forwards ``("F", m)`` and backwards ``("B", m)``; for ``"interleaved"``
    ``("F", m, c)`` and ``("B", m, c)`` with ``c`` the rank's chunk, virtual stage ``c * num_stages + stage``
    (Megatron-LM's order: rounds of ``p`` micro-batches per chunk, ``2 (p - s - 1) + (v - 1) p`` warm-up
    forwards, then one forward and one backward alternately)."""
    if schedule == "gpipe":
        return [("F", m) for m in range(micro_batches)] + [("B", m) for m in range(micro_batches)]
    if schedule == INTERLEAVED:
        check_interleaved(num_stages, micro_batches, virtual_stages)
        p, v = num_stages, virtual_stages

        def op(kind: str, k: int) -> tuple[str, int, int]:
            chunk = (k // p) % v
            return kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk

        total = micro_batches * v
        warmup = interleaved_warmup(p, stage, micro_batches, v)
        order = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [op("F", warmup + k), op("B", k)]
        return order + [op("B", k) for k in range(total - warmup, total)]
    warmup = min(num_stages - stage - 1, micro_batches)
    order = [("F", m) for m in range(warmup)]
    for m in range(micro_batches - warmup):
        order += [("F", warmup + m), ("B", m)]
    return order + [("B", m) for m in range(micro_batches - warmup, micro_batches)]


def schedule_bubble(orders: Sequence[Sequence[tuple]], forward_cost: float = 1.0, backward_cost: float = 2.0) -> float:
    """Idle fraction of the step when every stage runs ``orders[s]`` with these costs (of the whole stage: a chunk
    of ``v`` costs ``1/v`` of them), each op starting as soon as its input arrived (``F`` of virtual stage ``u``
    after ``F(u - 1)``, ``B(u)`` after ``B(u + 1)``, virtual stage ``c * p + s``) and the stage is free.
    For GPipe and 1F1B with equal stages it is ``(p - 1) / (m + p - 1)``."""
    p = len(orders)
    v = 1 + max((op[2] for order in orders for op in order if len(op) == 3), default=0)
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    clock = [0.0] * p
    position = [0] * p
    while any(position[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if position[s] == len(orders[s]):
                continue
            kind, m, *chunk = orders[s][position[s]]
            u = (chunk[0] if chunk else 0) * p + s
            dep = ("F", u - 1, m) if kind == "F" and u > 0 else ("B", u + 1, m) if kind == "B" and u < last else None
            if kind == "B" and u == last:
                dep = ("F", u, m)
            if dep is not None and dep not in done:
                continue
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            clock[s] = done[(kind, u, m)] = start + (forward_cost if kind == "F" else backward_cost) / v
            position[s] += 1
            progressed = True
        if not progressed:
            raise ValueError("the stage orders deadlock: some op waits for one that never runs")
    makespan = max(clock)
    busy = sum(len(order) for order in orders) / 2 * (forward_cost + backward_cost) / v
    return 1.0 - busy / (p * makespan)
