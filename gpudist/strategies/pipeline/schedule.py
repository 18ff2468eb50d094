"""Splitting a model into stages and scheduling micro-batches: pure functions (the tests and the benchmark use
them directly)."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = [
    "ALL_SCHEDULES",
    "DUALPIPE_V",
    "INTERLEAVED",
    "SCHEDULES",
    "ZBV",
    "ZERO_BUBBLE",
    "activations_alive",
    "check_interleaved",
    "check_schedule",
    "interleaved_warmup",
    "partition_blocks",
    "placement",
    "replay",
    "schedule_bubble",
    "stage_schedule",
    "virtual_stage",
]

SCHEDULES = ("1f1b", "gpipe")
"""The one-chunk schedules without a split backward (1F1B, GPipe)."""
INTERLEAVED = "interleaved"
"""Interleaved 1F1B: ``v`` virtual stages (chunks) per rank, placed round-robin (``"loop"``)."""
ZERO_BUBBLE = "zero_bubble"
"""ZB-H1 (Qi et al. 2023): 1F1B with each backward split into its input-gradient pass ``B`` and its
weight-gradient pass ``W``, the ``W`` s of stage ``s``'s first ``s`` backwards deferred into its cool-down."""
ZBV = "zbv"
"""ZB-V (Qi et al. 2023, section 6): two chunks per rank in a V (``"v"`` placement), split backwards."""
DUALPIPE_V = "dualpipev"
"""DualPipe-V (DeepSeek-V3's DualPipe cut to a V): two chunks per rank, a forward of one chunk paired with a
backward of the other in the steady state; full backwards there, split ones at the ends."""
ALL_SCHEDULES = (*SCHEDULES, INTERLEAVED, ZERO_BUBBLE, ZBV, DUALPIPE_V)
"""Every schedule ``PipelineParallelModel`` and ``HybridShardedModel`` take."""


def placement(schedule: str) -> str:
    """How ``schedule`` places chunks on ranks: ``"v"`` (ZB-V, DualPipe-V: rank ``s`` holds virtual stages ``s``
    and ``2 p - 1 - s``) or ``"loop"`` (rank ``s`` holds ``s, s + p, ...``; one chunk without interleaving)."""
    return "v" if schedule in (ZBV, DUALPIPE_V) else "loop"


def virtual_stage(where: str, num_stages: int, stage: int, chunk: int) -> int:
    """The position in the model (virtual stage) of rank ``stage``'s chunk ``chunk`` under placement ``where``."""
    if where == "v":
        return stage if chunk == 0 else 2 * num_stages - 1 - stage
    return chunk * num_stages + stage


def holder(where: str, num_stages: int, u: int) -> tuple[int, int]:
    """``(rank, chunk)`` holding virtual stage ``u`` under placement ``where`` (the inverse of
    :func:`virtual_stage`)."""
    if where == "v":
        return (u, 0) if u < num_stages else (2 * num_stages - 1 - u, 1)
    return u % num_stages, u // num_stages


def check_schedule(schedule: str, num_stages: int, micro_batches: int, virtual_stages: int | None) -> int:
    """Check ``schedule`` against the other settings and return the chunks per rank it runs, naming the fix.

    Raises:
        ValueError: When ``schedule`` is unknown; for ``"interleaved"`` as :func:`check_interleaved`; when
            ``virtual_stages`` is given other than 2 for ``"zbv"``/``"dualpipev"`` (their V holds two chunks per
            rank) or other than 1 for the rest; or for ``"dualpipev"`` when ``micro_batches < 2 num_stages``
            (its steady state pairs a forward of one chunk with a backward of the other, which needs both
            chunks' warm-ups done: torch's ``ScheduleDualPipeV`` refuses the same).
    """
    if schedule not in ALL_SCHEDULES:
        raise ValueError(f"schedule={schedule!r}; use one of {ALL_SCHEDULES}")
    if schedule == INTERLEAVED:
        v = 2 if virtual_stages is None else virtual_stages
        check_interleaved(num_stages, micro_batches, v)
        return v
    if placement(schedule) == "v":
        if virtual_stages not in (None, 2):
            raise ValueError(
                f"virtual_stages={virtual_stages!r}: schedule={schedule!r} holds exactly 2 chunks per rank (a V); "
                "leave virtual_stages unset, or use schedule='interleaved' for another count"
            )
        if schedule == DUALPIPE_V and micro_batches < 2 * num_stages:
            raise ValueError(
                f"schedule='dualpipev' needs micro_batches >= 2 x num_stages = {2 * num_stages}, got "
                f"micro_batches={micro_batches}; use {2 * num_stages} or more, or schedule='zbv'"
            )
        return 2
    if virtual_stages not in (None, 1):
        raise ValueError(
            f"virtual_stages={virtual_stages!r} needs schedule='interleaved' (got {schedule!r}); zbv and "
            "dualpipev hold 2 chunks per rank without it"
        )
    return 1


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
    """The order in which ``stage`` runs forwards ``("F", m)``, backwards ``("B", m)`` and, where a backward is split
    (``zero_bubble``, ``zbv``, ``dualpipev``), weight-gradient passes ``("W", m)``: a ``B`` with a ``W`` later in the
    order computes only its input's gradient, its ``W`` the parameters'. With several chunks per rank the ops are
    ``("F", m, c)`` with ``c`` the rank's chunk (:func:`virtual_stage` under :func:`placement`).

    - ``"interleaved"``: Megatron-LM's order: rounds of ``p`` micro-batches per chunk, ``2 (p - s - 1) + (v - 1) p``
      warm-up forwards, then one forward and one backward alternately.
    - ``"zero_bubble"`` (ZB-H1): 1F1B's forwards and backwards, each backward followed by the ``W`` of the oldest
      one not yet done, except that stage ``s`` runs its first ``s`` backwards without one: those ``W`` s fill the
      ``s`` backwards' time stage ``s`` would idle at the end of 1F1B, so at most ``p`` micro-batches are alive.
    - ``"zbv"`` (ZB-V): chunk 0 runs down the ranks and chunk 1 back up. Warm-up ``2 (p - s) - 1`` forwards of chunk
      0, then ``s`` pairs of forwards of both chunks, then ``p - s`` of chunk 1 each with its ``B`` and ``W``; the
      steady state runs ``F B W`` on chunk 0 and then on chunk 1; the cool-down runs ``s`` pairs of ``B`` s, then
      ``p - s`` ``B W`` on chunk 0, then the ``W`` s left. Built for at least ``2 p - 1`` micro-batches (the V's
      depth) with the ops of those past ``micro_batches`` left out.
    - ``"dualpipev"`` (DualPipe-V): ``2 (p - s - 1)`` forwards of chunk 0, ``s + 1`` pairs of forwards, ``p - s - 1``
      times a split ``B`` of chunk 1, its ``W`` and a forward of chunk 1; then the steady state pairs a forward of
      one chunk with a full backward of the other (on a GPU the two overlap, one's compute hiding the other's
      communication; here they run in that order); the cool-down's backwards are split from halfway through
      stage ``s``'s last ``s + 1`` pairs, and their ``W`` s fill the end.
    """
    p, s, m = num_stages, stage, micro_batches
    if schedule == "gpipe":
        return [("F", k) for k in range(m)] + [("B", k) for k in range(m)]
    if schedule == INTERLEAVED:
        check_interleaved(p, m, virtual_stages)
        v = virtual_stages

        def op(kind: str, k: int) -> tuple[str, int, int]:
            chunk = (k // p) % v
            return kind, (k // (p * v)) * p + k % p, chunk if kind == "F" else v - 1 - chunk

        total = m * v
        warmup = interleaved_warmup(p, s, m, v)
        order = [op("F", k) for k in range(warmup)]
        for k in range(total - warmup):
            order += [op("F", warmup + k), op("B", k)]
        return order + [op("B", k) for k in range(total - warmup, total)]
    if schedule == ZBV:
        return _zbv(p, s, m)
    if schedule == DUALPIPE_V:
        check_schedule(schedule, p, m, None)
        return _dualpipev(p, s, m)
    warmup = min(p - s - 1, m)
    order = [("F", k) for k in range(warmup)]
    deferred: list[int] = []  # backwards whose W has not run (zero_bubble)
    for k in range(m):
        if warmup + k < m:
            order.append(("F", warmup + k))
        order.append(("B", k))
        if schedule == ZERO_BUBBLE:
            deferred.append(k)
            if k >= s:
                order.append(("W", deferred.pop(0)))
    return order + [("W", k) for k in deferred]


class _Counted:
    """An order being built op by op, each chunk's forwards, backwards and W's numbered in turn."""

    def __init__(self):
        self.order: list[tuple[str, int, int]] = []
        self.count = {(kind, c): 0 for kind in "FBW" for c in (0, 1)}
        self.unweighted: list[tuple[int, int]] = []  # (micro-batch, chunk) of split backwards without their W

    def run(self, kind: str, c: int, split: bool = True) -> None:
        """The next ``kind`` op of chunk ``c``; a backward with ``split`` gets its W later (:meth:`weight`), one
        without is a full backward."""
        m = self.count[(kind, c)]
        self.order.append((kind, m, c))
        self.count[(kind, c)] = m + 1
        if kind == "B" and split:
            self.unweighted.append((m, c))

    def weight(self, c: int | None = None) -> None:
        """The W of the oldest split backward without one (of chunk ``c``, when given), if there is one."""
        for i, (m, chunk) in enumerate(self.unweighted):
            if c is None or chunk == c:
                self.order.append(("W", m, chunk))
                del self.unweighted[i]
                return


def _zbv(p: int, s: int, m: int) -> list[tuple[str, int, int]]:
    depth = max(m, 2 * p - 1)  # micro-batches the V needs to reach its steady state; those past m are left out
    o = _Counted()
    for _ in range(2 * (p - s) - 1):
        o.run("F", 0)
    for _ in range(s):
        o.run("F", 1)
        o.run("F", 0)
    for _ in range(p - s):
        o.run("F", 1)
        o.run("B", 1)
        o.weight(1)
    while o.count[("F", 1)] < o.count[("F", 0)] or o.count[("F", 0)] < depth:
        if o.count[("F", 0)] < depth:
            o.run("F", 0)
        for c in (0, 1):
            if c == 1:
                o.run("F", 1)
            o.run("B", c)
            o.weight(c)
    for _ in range(s):
        o.run("B", 0)
        o.run("B", 1)
    for _ in range(p - s):
        o.run("B", 0)
        o.weight(0)
    for c in (1, 0):
        while any(chunk == c for _, chunk in o.unweighted):
            o.weight(c)
    return [op for op in o.order if op[1] < m]


def _dualpipev(p: int, s: int, m: int) -> list[tuple[str, int, int]]:
    o = _Counted()
    for _ in range(2 * (p - s - 1)):
        o.run("F", 0)
    for _ in range(s + 1):
        o.run("F", 0)
        o.run("F", 1)
    for _ in range(p - s - 1):
        o.run("B", 1)
        o.weight()
        o.run("F", 1)
    for _ in range(m - 2 * p + s + 1):  # the steady state: F of one chunk with the full B of the other
        o.run("F", 0)
        o.run("B", 1, split=False)
        o.run("F", 1)
        o.run("B", 0, split=False)
    for _ in range(p - s - 1):
        o.run("B", 1, split=False)
        o.run("F", 1)
        o.run("B", 0, split=False)
    split = False
    for i in range(s + 1):  # from halfway on, backwards leave their W for the end
        split = split or (i == (s + 1) // 2 and s % 2 == 1)
        o.run("B", 1, split)
        split = split or (i == (s + 1) // 2 and s % 2 == 0)
        o.run("B", 0, split)
    for _ in range(p - s - 1):
        o.weight()
        o.run("B", 0, split)
    for _ in range(s + 1):
        o.weight()
    return o.order


def activations_alive(order: Sequence[tuple], weights: Sequence[float] | None = None) -> tuple[float, list[int]]:
    """The most activations ``order`` keeps alive at once, and how many micro-batches each chunk had alive at that
    peak: a micro-batch's activations on chunk ``c`` count ``weights[c]`` (default 1 each) from its forward to its
    ``W`` when its backward is split, or to its whole backward."""
    chunks = _chunks([order])
    weights = [1] * chunks if weights is None else list(weights)
    split = {op[1:] for op in order if op[0] == "W"}
    alive, peak, at_peak = [0] * len(weights), 0, [0] * len(weights)
    for op in order:
        c = op[2] if len(op) == 3 else 0
        alive[c] += 1 if op[0] == "F" else -1 if op[0] == "W" or op[1:] not in split else 0
        load = sum(a * w for a, w in zip(alive, weights, strict=True))
        if load > peak:
            peak, at_peak = load, list(alive)
    return peak, at_peak


def _chunks(orders: Sequence[Sequence[tuple]]) -> int:
    """Chunks per rank in ``orders``: ops name their chunk third, or there is one."""
    return 1 + max((op[2] for order in orders for op in order if len(op) == 3), default=0)


def replay(
    orders: Sequence[Sequence[tuple]],
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    where: str = "loop",
) -> list[list[float]]:
    """When each op of ``orders[s]`` finishes, per stage, when every stage runs its order with these costs (of the
    whole stage: a chunk of ``v`` costs ``1/v`` of them), each op starting as soon as its input arrived (``F`` of
    virtual stage ``u`` after ``F(u - 1)``, ``B(u)`` after ``B(u + 1)``, ``W(u)`` after ``B(u)``; virtual stages
    placed by ``where``, :func:`placement`) and the stage is free. A backward with its ``W`` in the order costs
    ``backward_cost - weight_cost`` and its ``W`` ``weight_cost`` (default: half the backward); one without,
    ``backward_cost``.

    Raises:
        ValueError: When the orders deadlock (an op waits for one that never runs).
    """
    p = len(orders)
    v = _chunks(orders)
    weight = backward_cost / 2 if weight_cost is None else weight_cost
    last = p * v - 1
    split = [{op[1:] for op in order if op[0] == "W"} for order in orders]
    cost = {"F": forward_cost / v, "B": (backward_cost - weight) / v, "W": weight / v, "whole": backward_cost / v}
    done: dict[tuple[str, int, int], float] = {}
    finish: list[list[float]] = [[] for _ in range(p)]
    clock = [0.0] * p
    while any(len(finish[s]) < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if len(finish[s]) == len(orders[s]):
                continue
            kind, m, *chunk = op = orders[s][len(finish[s])]
            u = virtual_stage(where, p, s, chunk[0] if chunk else 0)
            dep = {"F": ("F", u - 1, m) if u > 0 else None, "B": ("B", u + 1, m), "W": ("B", u, m)}[kind]
            if kind == "B" and u == last:
                dep = ("F", u, m)
            if dep is not None and dep not in done:
                continue
            duration = cost["whole" if kind == "B" and op[1:] not in split[s] else kind]
            start = max(clock[s], done[dep] if dep is not None else 0.0)
            clock[s] = done[(kind, u, m)] = start + duration
            finish[s].append(clock[s])
            progressed = True
        if not progressed:
            raise ValueError("the stage orders deadlock: some op waits for one that never runs")
    return finish


def schedule_bubble(
    orders: Sequence[Sequence[tuple]],
    forward_cost: float = 1.0,
    backward_cost: float = 2.0,
    weight_cost: float | None = None,
    where: str = "loop",
) -> float:
    """Idle fraction of the step when every stage runs ``orders[s]`` with these costs, as :func:`replay` times
    them. For GPipe and 1F1B with equal stages it is ``(p - 1) / (m + p - 1)``."""
    p = len(orders)
    v = _chunks(orders)
    makespan = max(f[-1] for f in replay(orders, forward_cost, backward_cost, weight_cost, where) if f)
    busy = sum(1 for order in orders for op in order if op[0] == "F") * (forward_cost + backward_cost) / v
    return 1.0 - busy / (p * makespan)
