"""Compile recorded Triton kernel launches for a GPU target, ahead of time, on a machine without a GPU.

    python tests/kernel_compile.py SPECS.json [TARGET ...] [--aligned] [--sass]
        (TARGET like cuda:90, cuda:80; default cuda:90)
    python -m tests.kernel_compile --write benchmarks/results/kernels_sass.json
        (from the repository root: records the aligned launches and writes the SASS report for this triton)

Runs in its own process, with Triton's interpreter off, so ``gpudist.kernels`` holds real ``JITFunction``s.
Each spec (written by tests/test_kernels_compile.py, which records every launch the public ops make in the
interpreter) names a kernel and the arguments of one launch: tensors become pointer types, Python scalars
i32/i64/fp32/i1, the kernel's ``tl.constexpr`` parameters their values. ``triton.compile`` then runs Triton's
whole pipeline (TTIR, TTGIR, LLVM IR, PTX, and ``ptxas`` to a cubin), which is what a first launch on the GPU
does. Prints one JSON line per spec: the kernel, the target, ``ok`` and the error's first lines otherwise.

``--aligned`` compiles the specialization a real launch gets when its data is aligned: every argument the spec
lists under ``divisible`` (pointers 16-byte aligned, integers divisible by 16, decided at recording time by
Triton's own rule) carries ``tt.divisibility = 16``, as Triton's launcher attaches it. ``--sass`` adds what the
GPU would run: ``sass_report`` of the cubin (registers, local memory, global load/store widths, occupancy).

Run from a folder other than the repository root: there, ``gpudist`` would import from the source tree, which
has no ``gpudist/kernels`` (the editable install maps it from ``kernels/``).
"""

from __future__ import annotations

import collections
import datetime
import importlib
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

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

# One Hopper SM (H100, sm_90; CUDA occupancy calculator, compute capability 9.0): 64K 32-bit registers,
# allocated per warp in units of 256; 64 resident warps; 32 resident blocks; 228 KiB of shared memory, of which
# each block also reserves 1 KiB.
SM90 = {"registers": 65536, "register_unit": 256, "warps": 64, "blocks": 32, "shared": 233472, "shared_reserved": 1024}

# A global memory instruction: LDG/STG, then modifiers (E, EL, CONSTANT, 128, U16, ...), e.g. "LDG.E.128".
_MEMORY_OP = re.compile(r"\b(LDG|STG|LDL|STL)((?:\.[A-Z0-9_]+)*)")
_RESOURCES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
# The instructions that order memory between threads and programs: barriers, fences, atomics, L1 invalidation.
_ORDERING_OP = re.compile(r"\b((?:BAR|MEMBAR|ATOMG|RED|CCTL)(?:\.[A-Z0-9_]+)+)")


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


def divisibility_attrs(fn, names, target):
    """``ASTSource`` attrs saying the parameters ``names`` are divisible by 16, as Triton's launcher writes them.

    Triton 3.3 onwards (3.6 and 3.9 alike) keys them by the parameter's index path, ``{(i,): [["tt.divisibility",
    16]]}``, made by ``backend.parse_attr("D")`` from the launcher's specialization key ("D": divisible by 16).
    Earlier versions took an ``AttrsDescriptor`` instead; they are not supported here.
    """
    from triton.compiler.compiler import make_backend

    backend = make_backend(target)
    if not hasattr(backend, "parse_attr"):
        raise RuntimeError("this triton predates attrs keyed by parameter index (3.3); use triton >= 3.3")
    index = {param.name: i for i, param in enumerate(fn.params)}
    return {(index[name],): backend.parse_attr("D") for name in names}


def source(spec: dict, target=None, aligned: bool = False):
    """The ``ASTSource`` of one recorded launch (``aligned``: with its ``divisible`` arguments marked so)."""
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
    attrs = None
    if aligned:
        divisible = [name for name in spec.get("divisible", ()) if signature.get(name, "constexpr") != "constexpr"]
        attrs = divisibility_attrs(fn, divisible, target)
    return ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)


def _tool(name: str) -> str:
    """The path of one of the CUDA binaries that ship inside Triton's wheel (cuobjdump, nvdisasm, ptxas)."""
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / name)


def access_width(modifiers: str) -> int:
    """Bits moved per thread by a global load/store, from its SASS modifiers (".E.128" -> 128, ".E" -> 32)."""
    parts = modifiers.split(".")
    for bits in ("128", "64"):
        if bits in parts:
            return int(bits)
    for part in parts:
        if part in ("U16", "S16"):
            return 16
        if part in ("U8", "S8"):
            return 8
    return 32


def occupancy_sm90(registers: int, num_warps: int, shared_bytes: int) -> dict:
    """Resident warps per SM over the 64 possible, on sm_90, and what limits them (registers, warps or shared)."""
    per_warp = -(-max(registers, 1) * 32 // SM90["register_unit"]) * SM90["register_unit"]
    limits = {
        "registers": SM90["registers"] // (per_warp * num_warps),
        "warps": min(SM90["warps"] // num_warps, SM90["blocks"]),
    }
    if shared_bytes:
        limits["shared"] = SM90["shared"] // (shared_bytes + SM90["shared_reserved"])
    blocks = min(limits.values())
    return {
        "blocks_per_sm": blocks,
        "occupancy": round(blocks * num_warps / SM90["warps"], 4),
        "limited_by": min(limits, key=limits.get),
    }


def sass_report(cubin: bytes, num_warps: int, shared_bytes: int) -> dict:
    """Registers, local memory, global load/store widths and estimated sm_90 occupancy of one kernel's cubin.

    ``cuobjdump -res-usage -sass`` gives the register count (``REG``), the per-thread stack and local memory
    (spilled registers land there), static shared memory, and the SASS. Global accesses are counted by the
    width each thread moves per instruction: ``{"128": 8, "32": 2}`` is eight LDG.E.128 and two LDG.E.
    ``local_accesses`` counts LDL/STL, the instructions a spill or a local array produces. ``ordering`` lists the
    barriers, fences, atomics and cache invalidations in program order (what a cross-program handshake rests on).
    ``n_spills`` of the compiled kernel's metadata is filled only when a GPU loads it, so registers come from the
    cubin here.
    """
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        done = subprocess.run(
            [_tool("cuobjdump"), "-res-usage", "-sass", str(path)], capture_output=True, text=True, check=True
        )
    registers, stack, static_shared, local = (int(v) for v in _RESOURCES.search(done.stdout).groups())
    widths = {"LDG": collections.Counter(), "STG": collections.Counter()}
    local_accesses = 0
    for opcode, modifiers in _MEMORY_OP.findall(done.stdout):
        if opcode in widths:
            widths[opcode][str(access_width(modifiers))] += 1
        else:
            local_accesses += 1
    shared = static_shared + shared_bytes
    return {
        "registers": registers,
        "stack_bytes": stack,
        "local_bytes": local,
        "local_accesses": local_accesses,
        "shared_bytes": shared,
        "num_warps": num_warps,
        "ordering": _ORDERING_OP.findall(done.stdout),
        "loads": dict(sorted(widths["LDG"].items(), key=lambda kv: -int(kv[0]))),
        "stores": dict(sorted(widths["STG"].items(), key=lambda kv: -int(kv[0]))),
        **occupancy_sm90(registers, num_warps, shared),
    }


def compile_spec(spec: dict, target: str, aligned: bool = False) -> tuple[dict, object]:
    """Compile one spec for ``target``: the JSON row, and the compiled kernel (None when it failed)."""
    import triton
    from triton.backends.compiler import GPUTarget

    backend, arch = target.split(":")
    gpu = GPUTarget(backend, int(arch), 32)
    options = {k: v for k, v in spec["options"].items() if k in OPTIONS}
    row = {"kernel": spec["kernel"], "target": target, "args": spec["args"], "triton": triton.__version__}
    if aligned:
        row["aligned"] = True
    if "variant" in spec:
        row["variant"] = spec["variant"]
    compiled = None
    try:
        compiled = triton.compile(source(spec, gpu, aligned), target=gpu, options=options)
        row["ok"] = bool(compiled.asm.get("cubin"))
        row["ptx_lines"] = compiled.asm["ptx"].count("\n")
        # PTX writes an fp64 immediate as 0d + 16 hex digits: which float64 constants survived compilation
        row["f64_constants"] = sorted(set(re.findall(r"\b0d([0-9A-F]{16})\b", compiled.asm["ptx"])))
    except Exception as e:
        row["ok"], row["error"] = False, f"{type(e).__name__}: {str(e)[:2000]}"
    return row, compiled


def _with_sass(row: dict, compiled) -> dict:
    if compiled is not None and row["ok"]:
        row["sass"] = sass_report(compiled.asm["cubin"], compiled.metadata.num_warps, compiled.metadata.shared)
    return row


def main(argv: list[str]) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise SystemExit("kernel_compile: unset TRITON_INTERPRET (the interpreter replaces the compiler)")
    if argv[:1] == ["--write"]:
        return write_results(Path(argv[1]) if len(argv) > 1 else RESULTS)
    flags = {a for a in argv if a.startswith("--")}
    unknown = flags - {"--aligned", "--sass"}
    if unknown:
        raise SystemExit(f"kernel_compile: unknown option(s) {sorted(unknown)}; see the module docstring")
    paths = [a for a in argv if not a.startswith("--")]
    with open(paths[0]) as f:
        specs = json.load(f)
    # Compiling is Python-bound (one core); disassembling runs cuobjdump in a child process (~0.5 s each), so
    # with --sass the two overlap on a second core.
    with ThreadPoolExecutor(max_workers=2) as pool:
        rows = []
        for target in paths[1:] or ["cuda:90"]:
            for spec in specs:
                row, compiled = compile_spec(spec, target, "--aligned" in flags)
                rows.append(pool.submit(_with_sass, row, compiled if "--sass" in flags else None))
        for row in rows:
            print(json.dumps(row.result()), flush=True)
    return 0


# ---------------------------------------------------------------------------------------- benchmarks/results
RESULTS = Path("benchmarks/results/kernels_sass.json")
COMMAND = (
    "python -m tests.kernel_compile --write benchmarks/results/kernels_sass.json (from the repository root; it writes "
    "the section of the triton it imports: the 3.6.0 one ran under a venv holding triton==3.6.0)"
)


def write_results(path: Path) -> int:
    """Record the aligned launches (tests/test_kernels_compile.py, in the interpreter), compile them for sm_90
    with ``--sass``, and write one section per triton version into ``path`` (other versions' sections kept)."""
    import torch
    import triton

    with tempfile.TemporaryDirectory() as folder:
        rows_file = Path(folder) / "rows.json"
        env = dict(os.environ, GPUDIST_SASS_ROWS=str(rows_file))
        test = "tests/test_kernels_compile.py::test_aligned_kernels_vectorize"
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow", test], env=env
        )
        if not rows_file.exists():
            raise SystemExit(f"kernel_compile: {test} wrote no rows (exit {done.returncode})")
        rows = json.loads(rows_file.read_text())
    from gpudist.bench import environment

    machine = environment()
    kernels = {}
    for row in rows:  # a variant may launch several kernels, and one kernel in several specializations
        key = name = f"{row.get('variant', row['kernel'])}: {row['kernel']}"
        while key in kernels:
            key = f"{name} #{sum(k.startswith(name) for k in kernels) + 1}"
        kernels[key] = {"kernel": row["kernel"], "ok": row["ok"], **row.get("sass", {"error": row.get("error")})}
    results = json.loads(path.read_text()) if path.exists() else {}
    results.update(
        {
            "benchmark": "kernels_sass",
            "what": "the aligned specialization (pointers 16-byte aligned, sizes divisible by 16) of each hot "
            "Triton kernel launch, compiled ahead of time for sm_90 with no GPU; per kernel: registers per thread, "
            "local memory and LDL/STL count (spills), global loads and stores counted by the bits each thread "
            "moves per instruction (128 = LDG.E.128/STG.E.128), and occupancy estimated for an H100 SM from "
            "registers, warps and shared memory. Compilation only: no timings.",
            "command": COMMAND,
            "python": platform.python_version(),
            "torch": torch.__version__,
        }
    )
    results.pop("machine", None)  # (now per section: the sections may come from different machines)
    section = f"triton {triton.__version__} cuda:90"
    results.setdefault("results", {})[section] = {
        "date": datetime.date.today().isoformat(),
        "machine": f"{machine['cpu']}, {machine['cpu_count']} cores, no GPU",
        "kernels": kernels,
    }
    results["results"] = dict(sorted(results["results"].items()))
    path.write_text(json.dumps(results, indent=1) + "\n")
    print(f"kernel_compile: wrote {len(kernels)} kernels under {section!r} in {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
