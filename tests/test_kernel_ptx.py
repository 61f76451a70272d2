"""The fused kernels round where torch's ops round also when compiled: their sm_90 PTX holds no
fma.rn.bf16 (a rounded product and a sum contracted into one rounding), which Triton's CPU
interpreter never shows and which made the RoPE kernel differ from torch by 1 ulp on the GPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _kernel_ptx(*args: str) -> dict:
    """tests/kernel_ptx.py's JSON, run in its own process without the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run([sys.executable, str(ROOT / "tests" / "kernel_ptx.py"), *args], env=env,
                          capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_exact_rounding_kernels_compile_without_bf16_fma() -> None:
    counts = _kernel_ptx()
    assert all(exact == 0 for exact, _ in counts.values()), counts
    # Without the option the compiler contracts them: the check sees what it guards against.
    assert counts["rope"][1] > 0 and counts["add_norm"][1] > 0 and counts["qkv_epilogue"][1] > 0, counts


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_attention_kernel_compiles_for_every_kv_dtype() -> None:
    """bf16, e4m3 and e5m2 K/V: the tiled attention kernel compiles for sm_90 (with bf16 KV it did
    not after the float8 change, which only a GPU showed), with the decode tile and the prompt
    tiles (unmasked loop first; MHA and GQA), the decode tile that reads its first key block
    before the PDL wait, and the vector decode kernel with and without that prefetch."""
    tiles = ("", "-prefetch", "-prompt", "-prompt-gqa", "-vector", "-vector-prefetch")
    want = {kv + tile: True for kv in ("bf16", "e4m3", "e5m2") for tile in tiles}
    assert _kernel_ptx("--attention") == want
