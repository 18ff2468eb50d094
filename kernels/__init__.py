"""gpudist.kernels: Triton kernels with torch references of the same signature (see DESIGN.md, "Kernels").

Knows nothing of communication or nn.Modules. The kernels themselves land with the kernel issue.
"""

__all__: list[str] = []
