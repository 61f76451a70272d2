"""Put a test module on Triton's CPU interpreter, or skip it.

Triton reads TRITON_INTERPRET when it is first imported, so a module that tests kernels in the
interpreter calls `select` at collection, before anything imports triton. Where a CUDA device
exists the module is skipped: compiled kernels run there, in the GPU tests named.
"""

from __future__ import annotations

import importlib.util
import os
import sys

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
