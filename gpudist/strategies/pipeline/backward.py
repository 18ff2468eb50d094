"""A chunk's backward in two passes, for the zero-bubble schedules: the gradient of its input first (what the
previous stage waits for), its parameters' gradients later (what nobody waits for: it fills the bubble).

The input pass runs ``torch.autograd.grad`` from the chunk's outputs to its input only, keeping the graph. Autograd
then runs just the nodes on the way to the input, and each of them computes only the gradient of the input side (an
``addmm`` node makes ``dX = dY W`` but not ``dW = X^T dY``). On the way, a pre-hook records the output gradient
of every *boundary* node: a node on the input's path from which a parameter is reached off that path (the
``addmm`` itself, whose weight hangs off it). The weight pass starts autograd again at each boundary node, from
the gradient recorded there, towards the parameters reached from it; those reached from a boundary are never
reached from another through the input's path (that path would hold a boundary of its own: see
:class:`SplitBackward`), so autograd computes the parameter side of the boundary node and what lies beyond it,
nothing else, and the two passes together do the work of one backward.

Memory: the output tensors are dropped after the input pass, which frees the nodes above the boundaries (torch's
``stage_backward_input`` detaches them for the same reason); the boundary nodes keep the rest of the graph (and the
activations it saved) until the weight pass, which frees them. A micro-batch's activations count as alive from its
forward to its weight pass in the schedules' memory bounds.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, _engine_run_backward, get_gradient_edge

__all__ = ["SplitBackward"]

_ACCUMULATE_GRAD = torch._C._functions.AccumulateGrad  # a leaf's node; its ``variable`` is the leaf


def _node(t: torch.Tensor):
    """The autograd node a gradient for ``t`` enters the graph through (its accumulator for a leaf)."""
    return get_gradient_edge(t).node


class SplitBackward:
    """One micro-batch's backward through one chunk, split into :meth:`input_pass` and :meth:`weight_pass`.

    ``outputs`` are the chunk's outputs that carry a gradient (the scaled loss on the last chunk), ``grads`` their
    gradients (None for the loss), ``inputs`` the received tensors that need one (none on the first chunk: the
    weight pass then runs the whole backward) and ``params`` the chunk's trainable parameters.

    Where a parameter is reached from two boundaries (a weight used twice in the chunk, on both sides of the
    input's path), restarting at both would count the lower one's share twice. Then the weight pass runs the
    whole backward again from the outputs instead (kept until then), parameters only: exact, but the input's
    path is computed twice for that micro-batch.
    """

    def __init__(
        self,
        outputs: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor] | None,
        inputs: Sequence[torch.Tensor],
        params: Sequence[torch.Tensor],
    ):
        self.outputs, self.grads = list(outputs), None if grads is None else list(grads)
        self.inputs, self.params = list(inputs), [p for p in params if p.requires_grad]
        # per restart of the weight pass: its gradient edges (or outputs), their gradients, the parameters it reaches
        self.starts: list[tuple[tuple, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = []
        self.whole = False  # whether the weight pass reruns the whole backward

    def input_pass(self) -> list[torch.Tensor]:
        """The inputs' gradients (zeros for an input the outputs do not depend on); records what the weight pass
        needs. Parameters' ``.grad`` are not touched."""
        if not self.inputs:
            self.whole = True
            return []
        boundaries, from_roots = self._boundaries()
        recorded: dict[object, tuple] = {}
        hooks = [b.register_prehook(lambda grad_out, b=b: recorded.__setitem__(b, grad_out)) for b in boundaries]
        try:
            got = torch.autograd.grad(self.outputs, self.inputs, self.grads, retain_graph=True, allow_unused=True)
        finally:
            for hook in hooks:
                hook.remove()
        if not self.whole:
            for b, params in boundaries.items():
                edges = [(GradientEdge(b, k), g) for k, g in enumerate(recorded.get(b, ())) if g is not None]
                if edges and params:
                    self.starts.append((tuple(e for e, _ in edges), tuple(g for _, g in edges), params))
            for k, params in from_roots.items():  # outputs computed from parameters only
                grad = torch.ones_like(self.outputs[k]) if self.grads is None else self.grads[k]
                self.starts.append(((self.outputs[k],), (grad,), params))
            self.outputs = self.grads = None  # frees the graph above the boundaries
        return [torch.zeros_like(x) if g is None else g for x, g in zip(self.inputs, got, strict=True)]

    def weight_pass(self) -> None:
        """Accumulate the parameters' gradients into their ``.grad``, then free the graph."""
        if self.whole:
            if self.params:
                torch.autograd.backward(self.outputs, self.grads, inputs=self.params)
        else:
            # Straight to the engine: the gradients were recorded from it, so torch.autograd.backward's checks of
            # them (_make_grads) are redundant, and they were about half of its host time per restart.
            for edges, grads, params in self.starts:
                _engine_run_backward(edges, grads, False, False, params, allow_unreachable=True, accumulate_grad=True)
        self.outputs = self.grads = self.inputs = self.starts = None

    def _boundaries(self) -> tuple[dict, dict[int, tuple[torch.Tensor, ...]]]:
        """Per boundary node, the parameters it reaches off the input's path; per output index whose node is off
        that path, the parameters reached from it. Sets ``whole`` when a parameter is reached from two.

        One walk numbers the graph's nodes; the analysis of the numbered graph (:func:`_split_plan`) is cached, as
        every micro-batch of a chunk usually builds the same graph. Inputs and parameters are found among the
        walk's gradient accumulators, as ``get_gradient_edge`` of a leaf makes a view to reach its own (a view per
        parameter per micro-batch)."""
        roots = [_node(t) for t in self.outputs]
        nodes, index, children = _walk(roots)
        leaves = {id(node.variable): k for k, node in enumerate(nodes) if isinstance(node, _ACCUMULATE_GRAD)}

        def place(t: torch.Tensor) -> int:  # its node's number; -1: not in the graph
            return leaves.get(id(t), -1) if t.grad_fn is None else index.get(t.grad_fn, -1)

        boundaries, from_roots, self.whole = _split_plan(
            children,
            tuple(index[root] for root in roots),
            tuple(place(x) for x in self.inputs),
            tuple(place(p) for p in self.params),
        )
        return (
            {nodes[b]: tuple(self.params[i] for i in params) for b, params in boundaries},
            {k: tuple(self.params[i] for i in params) for k, params in from_roots},
        )


def _walk(roots: list) -> tuple[list, dict, tuple[tuple[int, ...], ...]]:
    """The nodes reached from ``roots`` (breadth first, so the numbering depends only on the graph's shape), their
    numbers, and per node the numbers of its children (-1 for an edge to nothing)."""
    nodes, index, children = [], {}, []
    for root in roots:
        if root not in index:
            index[root] = len(nodes)
            nodes.append(root)
    k = 0
    while k < len(nodes):
        kids = []
        for child, _ in nodes[k].next_functions:
            if child is None:
                kids.append(-1)
                continue
            j = index.get(child)
            if j is None:
                j = index[child] = len(nodes)
                nodes.append(child)
            kids.append(j)
        children.append(tuple(kids))
        k += 1
    return nodes, index, tuple(children)


@functools.lru_cache(maxsize=64)
def _split_plan(
    children: tuple[tuple[int, ...], ...], roots: tuple[int, ...], inputs: tuple[int, ...], params: tuple[int, ...]
) -> tuple[tuple[tuple[int, tuple[int, ...]], ...], tuple[tuple[int, tuple[int, ...]], ...], bool]:
    """:meth:`SplitBackward._boundaries` on a numbered graph (:func:`_walk`: ``children`` per node; the nodes of
    the outputs, inputs and parameters, -1 for one not in the graph): the boundary nodes with the positions of the
    parameters each reaches, the output positions whose node is off the input's path with theirs, and whether a
    parameter is reached from two (then the weight pass reruns the whole backward). A function of the graph's
    shape alone, so a chunk whose graph changes between micro-batches gets the plan of the graph it built."""
    parents: list[list[int]] = [[] for _ in children]  # node -> the nodes whose backward feeds it
    for node, kids in enumerate(children):
        for child in kids:
            if child >= 0:
                parents[child].append(node)
    on_path = {x for x in inputs if x >= 0}  # nodes from which an input is reached
    todo = list(on_path)
    while todo:
        for parent in parents[todo.pop()]:
            if parent not in on_path:
                on_path.add(parent)
                todo.append(parent)
    root_index = {node: k for k, node in enumerate(roots)}
    boundaries: dict[int, list[int]] = {}
    from_roots: dict[int, list[int]] = {}
    whole = False
    for i, start in enumerate(params):
        if start < 0:
            continue  # unused in this chunk for this micro-batch
        hits, visited, todo = set(), {start}, [start]
        while todo:
            node = todo.pop()
            if node in root_index and node not in on_path:
                hits.add((True, root_index[node]))
            for parent in parents[node]:
                if parent in on_path:
                    hits.add((False, parent))
                elif parent not in visited:
                    visited.add(parent)
                    todo.append(parent)
        whole = whole or len(hits) > 1
        for is_root, hit in hits:
            (from_roots if is_root else boundaries).setdefault(hit, []).append(i)
    return (
        tuple((b, tuple(ps)) for b, ps in boundaries.items()),
        tuple((k, tuple(ps)) for k, ps in from_roots.items()),
        whole,
    )
