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

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["SplitBackward"]


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
        self.starts: list[tuple[list, list[torch.Tensor]]] = []  # (gradient edges, their gradients) per boundary
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
                    self.starts.append(([e for e, _ in edges], [g for _, g in edges], params))
            for k, params in from_roots.items():  # outputs computed from parameters only
                grad = torch.ones_like(self.outputs[k]) if self.grads is None else self.grads[k]
                self.starts.append(([self.outputs[k]], [grad], params))
            self.outputs = self.grads = None  # frees the graph above the boundaries
        return [torch.zeros_like(x) if g is None else g for x, g in zip(self.inputs, got, strict=True)]

    def weight_pass(self) -> None:
        """Accumulate the parameters' gradients into their ``.grad``, then free the graph."""
        if self.whole:
            if self.params:
                torch.autograd.backward(self.outputs, self.grads, inputs=self.params)
        else:
            for edges, grads, params in self.starts:
                torch.autograd.backward(edges, grads, inputs=params)
        self.outputs = self.grads = self.inputs = self.starts = None

    def _boundaries(self) -> tuple[dict, dict[int, list[torch.Tensor]]]:
        """Per boundary node, the parameters it reaches off the input's path; per output index whose node is off
        that path, the parameters reached from it. Sets ``whole`` when a parameter is reached from two."""
        roots = [_node(t) for t in self.outputs]
        parents: dict[object, list] = {}  # node -> the nodes whose backward feeds it
        seen, todo = set(roots), list(roots)
        while todo:
            for child, _ in todo.pop().next_functions:
                if child is not None:
                    parents.setdefault(child, [])
                    if child not in seen:
                        seen.add(child)
                        todo.append(child)
        for node in seen:
            for child, _ in node.next_functions:
                if child is not None:
                    parents[child].append(node)
        on_path = {_node(x) for x in self.inputs} & seen  # nodes from which an input is reached
        todo = list(on_path)
        while todo:
            for parent in parents.get(todo.pop(), ()):
                if parent not in on_path:
                    on_path.add(parent)
                    todo.append(parent)
        boundaries: dict[object, list[torch.Tensor]] = {}
        from_roots: dict[int, list[torch.Tensor]] = {}
        root_index = {node: k for k, node in enumerate(roots)}
        for p in self.params:
            start = _node(p)
            if start not in seen:
                continue  # unused in this chunk for this micro-batch
            hits, visited, todo = set(), {start}, [start]
            while todo:
                node = todo.pop()
                if node in root_index and node not in on_path:
                    hits.add(("root", root_index[node]))
                for parent in parents.get(node, ()):
                    if parent in on_path:
                        hits.add(parent)
                    elif parent not in visited:
                        visited.add(parent)
                        todo.append(parent)
            if len(hits) > 1:
                self.whole = True
            for hit in hits:
                if isinstance(hit, tuple):
                    from_roots.setdefault(hit[1], []).append(p)
                else:
                    boundaries.setdefault(hit, []).append(p)
        return boundaries, from_roots
