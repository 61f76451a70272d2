"""Put a test module on Triton's CPU interpreter, or skip it.

Triton reads TRITON_INTERPRET when it is first imported, so a module that tests kernels in the
interpreter calls `select` at collection, before anything imports triton. Where a CUDA device
exists the module is skipped: compiled kernels run there, in the GPU tests named.

Triton 3.6's interpreter converts floats bit by bit and gets downcasts wrong: fp32 to bf16
truncates, and its round-to-nearest-even to float8 drops the carry into the exponent (7.83 becomes
4.0). Compiled kernels round to nearest even, as torch does, so `select` routes those conversions
through torch.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import numpy as np
import pytest
import torch


def select(gpu_tests: str) -> None:
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed (pip install 'triton==3.6.*' 'numpy<2.4')", allow_module_level=True)
    if torch.cuda.is_available():
        pytest.skip(f"a CUDA device is present: {gpu_tests} runs the compiled kernels", allow_module_level=True)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.fail("triton was imported in compiled mode before this module could select its interpreter")
    os.environ["TRITON_INTERPRET"] = "1"
    _round_like_the_gpu()


def _round_like_the_gpu() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter._convert_float, "exact", False):
        return
    torch_of = {tl.float32: torch.float32, tl.float16: torch.float16, tl.bfloat16: torch.bfloat16,
                tl.float8e4nv: torch.float8_e4m3fn, tl.float8e5: torch.float8_e5m2}  # fmt: skip
    signed = {4: (np.int32, torch.int32), 2: (np.int16, torch.int16), 1: (np.int8, torch.int8)}
    unsigned = {4: np.uint32, 2: np.uint16, 1: np.uint8}
    original = interpreter._convert_float

    def convert(input, input_dtype, output_dtype, rounding_mode):
        src, dst = torch_of.get(input_dtype), torch_of.get(output_dtype)
        if src is None or dst is None or rounding_mode == interpreter._ir.ROUNDING_MODE.RTZ:
            return original(input, input_dtype, output_dtype, rounding_mode)
        np_in, t_in = signed[src.itemsize]
        x = torch.from_numpy(np.ascontiguousarray(input).view(np_in).copy()).view(t_in).view(src)
        y = x.to(dst).view(signed[dst.itemsize][1]).numpy()
        return y.view(unsigned[dst.itemsize]).reshape(input.shape)

    convert.exact = True  # type: ignore[attr-defined]
    interpreter._convert_float = convert
