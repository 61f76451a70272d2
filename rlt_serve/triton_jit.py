"""Lazy `triton.jit`: Triton is imported, and kernels decorated, on first launch, not at import.

Triton picks its CPU interpreter (`TRITON_INTERPRET=1`) when it is imported and when a kernel is
decorated, and tests choose that per process, so nothing may import it earlier. Kernel modules
therefore write their kernels as plain functions over `tl` (under `from __future__ import
annotations` the `tl.constexpr` annotations stay unevaluated strings, which both the compiler
and the interpreter read) and launch them through `jit(fn)`. Device functions that kernels call
are marked `@device_function`; `jit` replaces each, in its module, by its decorated form first.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from typing import Any

_JITTED: dict[tuple[str, str, bool], Any] = {}
_PDL: dict[int, bool] = {}
_DEVICE_FUNCTIONS: list[tuple[str, str]] = []
_BOUND = [False, 0]  # the interpreter mode the device functions are decorated for, and how many are


def device_function(fn: Any) -> Any:
    """Marks a plain function over `tl` that kernels call; `jit` decorates it before any kernel."""
    _DEVICE_FUNCTIONS.append((fn.__module__, fn.__name__))
    return fn


def jit(fn: Any) -> Any:
    """`triton.jit(fn)`, decorated once per interpreter mode; binds `triton`/`tl` in fn's module."""
    import triton
    import triton.language as tl

    interpret = os.environ.get("TRITON_INTERPRET", "0") == "1"
    if _BOUND[0] != interpret:
        _BOUND[:] = [interpret, 0]
    for module_name, name in _DEVICE_FUNCTIONS[_BOUND[1] :]:
        helper_module = sys.modules[module_name]
        helper_module.triton, helper_module.tl = triton, tl
        plain = getattr(getattr(helper_module, name), "fn", getattr(helper_module, name))
        key = (module_name, name, interpret)
        if key not in _JITTED:
            _JITTED[key] = triton.jit(plain)
        setattr(helper_module, name, _JITTED[key])
    _BOUND[1] = len(_DEVICE_FUNCTIONS)
    module = sys.modules[fn.__module__]
    module.triton, module.tl = triton, tl
    key = (fn.__module__, fn.__name__, interpret)
    if key not in _JITTED:
        _JITTED[key] = triton.jit(fn)
    return _JITTED[key]


# Launch option for kernels that round where torch's ops round (a product to the dtype, then a sum):
# with FP fusion on, LLVM narrows such a pair to bf16 ops and contracts them into one fma.rn.bf16,
# skipping the product's rounding (seen in the sm_90 PTX of the RoPE kernel: 1-ulp differences).
EXACT_ROUNDING: dict[str, bool] = {"enable_fp_fusion": False}


def next_pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def triton_missing() -> str | None:
    """None when triton can be imported, else what to install (found without importing it)."""
    if importlib.util.find_spec("triton") is None:
        return "the 'triton' package is not installed (pip install 'triton==3.6.*')"
    return None


def pdl(x: Any) -> dict[str, bool]:
    """Launch options for programmatic dependent launch (PDL) of a kernel on `x`'s device.

    At concurrency 1 a decode step is ~1000 short kernels, each paying a launch and a ramp-up
    while the GPU drains the previous one. With PDL (Hopper and newer) a kernel is launched while
    its predecessor still runs: it may read weights early, and must `gdc_wait()` before touching
    anything an earlier kernel wrote. Kernels take a `PDL` constexpr: at its start
    `gdc_launch_dependents()`, then weight loads, `gdc_wait()`, the rest. `RLT_PDL=0` turns it off.
    """
    on = False
    if getattr(x, "is_cuda", False) and os.environ.get("RLT_PDL", "1") != "0":
        index = x.device.index if x.device.index is not None else 0
        if index not in _PDL:
            import torch

            _PDL[index] = torch.version.cuda is not None and torch.cuda.get_device_capability(index)[0] >= 9
        on = _PDL[index]
    return {"PDL": on, "launch_pdl": on}
