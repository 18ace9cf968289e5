"""Argument types of every Triton kernel launch, recorded under the Triton interpreter, and their
lowering to Triton IR for a real GPU target.

The interpreter runs a kernel as Python, so it accepts programs that Triton's compiler refuses
(a variable redefined with another type in a branch, for one). ``record`` (installed by
``tests/conftest.py`` when ``REDKNOT_RECORD_LAUNCHES`` names a file) notes, for each launch,
the kernel and the type of each argument (pointer element type, integer width, constexpr
value); ``lower`` compiles each recorded signature to Triton IR for an sm_90 target, which
needs no GPU. ``tests/kernels/test_triton_lowering.py`` runs both.
"""

from __future__ import annotations

import inspect
import json
import sys
from pathlib import Path

POINTER = {
    "torch.bfloat16": "*bf16", "torch.float16": "*fp16", "torch.float32": "*fp32",
    "torch.int32": "*i32", "torch.int64": "*i64", "torch.uint8": "*u8", "torch.bool": "*i1",
    "torch.int8": "*i8", "torch.float64": "*fp64",
}  # fmt: skip


def _type_of(value) -> str:
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        return POINTER[str(value.dtype)]
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    raise TypeError(f"no Triton type for a launch argument of type {type(value).__name__}")


def install(path: str) -> None:
    """Record the kernel launches of this process to ``path`` (JSON) at exit."""
    import atexit

    from triton.runtime.interpreter import InterpretedFunction

    specs: dict[str, dict] = {}
    real_run = InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = dict(zip(self.arg_names, args))
        bound.update(kwargs)
        signature, constexprs = {}, {}
        for name, param in params.items():
            if name not in bound:
                continue  # a defaulted parameter
            if "constexpr" in str(param.annotation):
                signature[name] = "constexpr"
                constexprs[name] = bound[name]
            else:
                signature[name] = _type_of(bound[name])
        spec = {
            "module": self.fn.__module__, "kernel": self.fn.__name__,
            "signature": signature, "constexprs": constexprs,
        }  # fmt: skip
        specs[json.dumps(spec, sort_keys=True)] = spec
        return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    InterpretedFunction.run = run
    atexit.register(lambda: Path(path).write_text(json.dumps(list(specs.values()))))


def lower(path: str) -> list[str]:
    """Compile each recorded launch to Triton IR for sm_90; returns one line per launch."""
    import importlib

    from triton._C import libtriton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    backend = CUDABackend(target)
    options = backend.parse_options({})
    lines = []
    for spec in json.loads(Path(path).read_text()):
        kernel = getattr(importlib.import_module(spec["module"]), spec["kernel"])
        src = ASTSource(kernel, spec["signature"], spec["constexprs"])
        context = libtriton.ir.context()
        libtriton.ir.load_dialects(context)
        backend.load_dialects(context)
        src.make_ir(
            target, options, backend.get_codegen_implementation(options),
            backend.get_module_map(), context,
        )  # fmt: skip
        lines.append(f"{spec['kernel']} {sorted(spec['constexprs'].items())}")
    return lines


if __name__ == "__main__":
    for line in lower(sys.argv[1]):
        print("lowered", line)
