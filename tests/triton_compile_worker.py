"""Compile recorded memra kernel launches with Triton's real compiler for GPU targets, on a machine with no
GPU: `python tests/triton_compile_worker.py 90,80 launches.json results.json JOBS full|quick`.

Run in its own process without TRITON_INTERPRET (the test suite's interpreter makes every @triton.jit an
interpreted function, which the compiler cannot take). Each record (tests/triton_launches.py) is bound and
specialized by Triton's own binder for the target's backend, exactly as `kernel[grid](...)` would on that
GPU, then compiled through to a cubin (ptxas ships in the Triton wheel; "quick": every variant through
the code generator, each kernel's first variant to a cubin). A kernel that compiles but asks for more
shared memory than the GPU gives a block would fail at launch: that fails here too.
Writes, per distinct kernel variant: its kernel, constexprs, whether it compiled (else the error's
message), and the @triton.jit functions it called (read off the module before inlining)."""

from __future__ import annotations

import importlib
import json
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
from triton import knobs
from triton._C.libtriton import ir
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, compile, make_backend
from triton.runtime.jit import MockTensor, create_function_from_signature

# The shared memory one block may use (cudaDevAttrMaxSharedMemoryPerBlockOptin): H100 227 KiB, A100 163 KiB.
SHARED_MEMORY = {90: 232448, 80: 166912}
CALLED = re.compile(r"tt\.func (?:public |private )?@([\w.]+?)(?:__\w*)?\(")


class _Tensor(MockTensor):
    """A tensor as Triton specializes it: its dtype and whether its address is 16-byte aligned."""

    def __init__(self, dtype: torch.dtype, aligned: bool):
        super().__init__(dtype)
        self.aligned = aligned

    def data_ptr(self):
        return 0 if self.aligned else 8


def _arg(desc):
    kind = desc[0]
    if kind == "tensor":
        return _Tensor(getattr(torch, desc[1]), desc[2])
    return {"bool": lambda: desc[1], "int": lambda: desc[1], "float": lambda: 0.5, "none": lambda: None}[kind]()


def _kernel(qualname: str):
    module, name = qualname.rsplit(".", 1)
    obj = getattr(importlib.import_module(module), name)
    return getattr(obj, "fn", obj) if type(obj).__name__ == "Lean" else obj


def _bind(capability: int, record) -> tuple:
    """A record bound and specialized as `kernel[grid](...)` binds it on that GPU -> (fn, ASTSource parts)."""
    qualname, args, kwargs = record
    fn = _kernel(qualname)
    backend = make_backend(GPUTarget("cuda", capability, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    # what JITFunction.run adds before binding
    kwargs = dict(kwargs, debug=fn.debug or knobs.runtime.debug, instrumentation_mode=knobs.compilation.instrumentation_mode)
    bound, specialization, options = binder(*[_arg(a) for a in args], **kwargs)
    return fn, fn._pack_args(backend, kwargs, bound, specialization, options)


def variant(capability: int, record) -> str:
    """What tells one compiled variant from another here: the kernel, its constexprs (defaults included),
    the types of its arguments and the compile options. Triton's alignment and divisibility hints on the
    runtime arguments also make separate binaries, but they change vector widths, not the code that is
    type-checked and lowered: one representative of each is compiled (that keeps the test in budget)."""
    fn, (options, signature, constexprs, _) = _bind(capability, record)
    shown = {fn.arg_names[k[0]]: repr(v) for k, v in constexprs.items()}
    return json.dumps([record[0], shown, signature, sorted(options.__dict__.items(), key=str)], default=str)


def _frontend(src: ASTSource, target: GPUTarget, options) -> str:
    """The kernel as Triton's code generator types and emits it (TTIR, before any pass): where a kernel the
    interpreter runs can still be refused (a name retyped in a loop, a constexpr misused)."""
    backend = make_backend(target)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    return str(src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(),
                           context))


def compile_one(capability: int, record, stage: str) -> dict:
    """One variant for one target: through the code generator only (stage "ttir"), or to a cubin."""
    target = GPUTarget("cuda", capability, 32)
    fn, (options, signature, constexprs, attrs) = _bind(capability, record)
    result = {"kernel": record[0], "target": capability, "stage": stage,
              "constexprs": {fn.arg_names[k[0]]: repr(v) for k, v in constexprs.items()},
              "signature": {k: v for k, v in signature.items() if v != "constexpr"}}
    start = time.perf_counter()
    src = ASTSource(fn, signature, constexprs, attrs)
    try:
        if stage == "ttir":
            source = _frontend(src, target, options)
        else:
            compiled = compile(src, target=target, options=options.__dict__)
            assert "cubin" in compiled.asm, "no cubin"
            shared = compiled.metadata.shared
            if shared > SHARED_MEMORY[capability]:
                raise RuntimeError(f"needs {shared} bytes of shared memory; sm_{capability} gives a block "
                                   f"{SHARED_MEMORY[capability]}")
            source = compiled.asm["source"]
        result["called"] = sorted(set(CALLED.findall(source)))
        result["ok"] = True
    except Exception as e:  # noqa: BLE001 -- every failure is reported, with its message
        result["ok"] = False
        result["error"] = f"{type(e).__name__}: {e}"
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


def compile_all(capabilities: list[int], records: list, jobs: int, full: bool) -> list[dict]:
    """Every distinct variant of the records for every target, over `jobs` processes (each takes the next
    compile as it finishes one: their lengths differ by 100x). full: every variant to a cubin; else every
    variant through the code generator, and each kernel's first variant to a cubin (module docstring)."""
    tasks, cubins = {}, set()
    for cap in capabilities:
        for record in records:
            key = (cap, variant(cap, record))
            if key not in tasks:
                stage = "cubin" if full or (cap, record[0]) not in cubins else "ttir"
                cubins.add((cap, record[0]))
                tasks[key] = (cap, record, stage)
    with ProcessPoolExecutor(jobs) as pool:
        return list(pool.map(compile_one, *zip(*tasks.values()), chunksize=1))


if __name__ == "__main__":
    caps, src, dst, jobs, how = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), sys.argv[5]
    with open(src) as f:
        records = json.load(f)
    with open(dst, "w") as f:
        json.dump(compile_all([int(c) for c in caps.split(",")], records, jobs, how == "full"), f)
