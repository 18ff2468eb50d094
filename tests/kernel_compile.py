"""Compile recorded Triton kernel launches for a GPU target, ahead of time, on a machine without a GPU.

    python tests/kernel_compile.py SPECS.json [TARGET ...]      (TARGET like cuda:90, cuda:80; default cuda:90)

Runs in its own process, with Triton's interpreter off, so ``gpudist.kernels`` holds real ``JITFunction``s.
Each spec (written by tests/test_kernels_compile.py, which records every launch the public ops make in the
interpreter) names a kernel and the arguments of one launch: tensors become pointer types, Python scalars
i32/i64/fp32/i1, the kernel's ``tl.constexpr`` parameters their values. ``triton.compile`` then runs Triton's
whole pipeline (TTIR, TTGIR, LLVM IR, PTX, and ``ptxas`` to a cubin), which is what a first launch on the GPU
does. Prints one JSON line per spec: the kernel, the target, ``ok`` and the error's first lines otherwise.

Run from a folder other than the repository root: there, ``gpudist`` would import from the source tree, which
has no ``gpudist/kernels`` (the editable install maps it from ``kernels/``).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

POINTER_TYPES = {
    "float32": "fp32",
    "bfloat16": "bf16",
    "float16": "fp16",
    "float64": "fp64",
    "int64": "i64",
    "int32": "i32",
    "int16": "i16",
    "int8": "i8",
    "uint8": "u8",
    "bool": "i1",
}
OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


def decode(value):
    """A recorded value back into what the launch passed (``{"tl": name}`` is a Triton dtype constant)."""
    import triton.language as tl

    if isinstance(value, dict) and "tl" in value:
        return getattr(tl, value["tl"])
    return value


def scalar_type(value) -> str:
    """Triton's type for a Python scalar launch argument (what its launcher would specialize it to)."""
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"unexpected launch argument {value!r}")


def source(spec: dict):
    """The ``ASTSource`` of one recorded launch."""
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    signature, constexprs = {}, {}
    for param in fn.params:
        name = param.name
        if name not in spec["args"]:
            continue  # a defaulted parameter the launch left out
        value = spec["args"][name]
        if param.is_constexpr or value is None:
            signature[name], constexprs[name] = "constexpr", decode(value)
        elif isinstance(value, dict) and "pointer" in value:
            signature[name] = "*" + POINTER_TYPES[value["pointer"]]
        else:
            signature[name] = scalar_type(value)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs)


def compile_spec(spec: dict, target: str) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget

    backend, arch = target.split(":")
    options = {k: v for k, v in spec["options"].items() if k in OPTIONS}
    row = {"kernel": spec["kernel"], "target": target, "args": spec["args"], "triton": triton.__version__}
    try:
        compiled = triton.compile(source(spec), target=GPUTarget(backend, int(arch), 32), options=options)
        row["ok"] = bool(compiled.asm.get("cubin"))
        row["ptx_lines"] = compiled.asm["ptx"].count("\n")
    except Exception as e:
        row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:2000]}"
    return row


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_compile: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
    with open(argv[0]) as f:
        specs = json.load(f)
    for target in argv[1:] or ["cuda:90"]:
        for spec in specs:
            print(json.dumps(compile_spec(spec, target)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
