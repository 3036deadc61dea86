"""Compiling Triton kernels to Hopper cubins without a GPU (ptxas ships with Triton): the
interpreter the CPU tests run does not type-check like the compiler."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def compile_sm90(kernel, constants: dict, pointers: dict, scalars: dict | None = None, num_warps: int = 4,
                 num_stages: int | None = None, aligned: tuple[str, ...] = ()) -> int:
    """Bytes of `kernel`'s sm_90 cubin: `constants` its constexprs, `pointers` / `scalars` the
    types of its other arguments by name (any other: an i32); `aligned`: arguments known divisible
    by 16, as a launch specializes 16-byte aligned pointers and such ints (what lets the compiler
    vectorize the loads and pipeline them)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    types = {**(scalars or {}), **pointers}
    signature = {name: "constexpr" if name in constants else types.get(name, "i32") for name in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(n),): v for n, v in constants.items()},
                       attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    options = dict(num_warps=num_warps, **({"num_stages": num_stages} if num_stages else {}))
    return len(triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options).asm["cubin"])


def run_without_interpreter(module: str, function: str) -> str:
    """What `module.function()` (a list of lines) prints in a Python without TRITON_INTERPRET."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = f"from {module} import {function}; print(*{function}(), sep='\\n')"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                            cwd=Path(__file__).resolve().parents[2])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout
