"""Compile the kernels that emulate torch's rounding for sm_90 (no GPU needed) and count the PTX
instructions that would skip a rounding: a bf16 multiply and add contracted into one fma.rn.bf16.

    python3 tests/kernel_ptx.py  ->  JSON {kernel: [fma count with EXACT_ROUNDING, without]}

Run in its own process (tests/test_kernel_ptx.py): the test session may hold Triton's interpreter.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from rlt_serve.models import fused_ops, gemv
from rlt_serve.triton_jit import EXACT_ROUNDING, jit

_FLOATS = {"eps_pre", "eps_post", "qk_scale"}


def fma_count(fn: Any, pointers: dict[str, str], constexprs: dict[str, Any], **options: Any) -> int:
    """fma.rn.bf16 instructions in fn's sm_90 PTX; arguments not named are i32 (fp32 for eps)."""
    kernel = jit(fn)
    sig = {}
    for name in inspect.signature(fn).parameters:
        sig[name] = "constexpr" if name in constexprs else pointers.get(name, "fp32" if name in _FLOATS else "i32")
    compiled = triton.compile(ASTSource(kernel, sig, constexprs), target=GPUTarget("cuda", 90, 32), options=options)
    return sum("fma.rn.bf16" in line for line in compiled.asm["ptx"].splitlines())


def main() -> None:
    bf = "*bf16"
    cases = {
        "rope": (fused_ops._rope_kernel, dict.fromkeys(("q_ptr", "k_ptr", "cos_ptr", "sin_ptr"), bf),
                 {"HALF": 64, "BLOCK": 64, "HEADS": 16, "PDL": False}, {"num_warps": 4}),
        "add_norm": (fused_ops._add_norm_kernel, dict.fromkeys(("x_ptr", "res_ptr", "h_ptr", "y_ptr", "w_pre", "w_post"), bf),
                     {"HAS_PRE": True, "HAS_RES": True, "HAS_POST": True, "BLOCK": 2048, "PDL": False}, {"num_warps": 4}),
        "silu_mul": (fused_ops._silu_mul_kernel, {"gu_ptr": bf, "out_ptr": bf}, {"BLOCK": 1024, "PDL": False},
                     {"num_warps": 4}),
        "qkv_epilogue": (
            gemv._gemv_kernel,
            {**dict.fromkeys(("x_ptr", "w_ptr", "y_ptr", "cos_ptr", "sin_ptr", "k_cache", "v_cache"), bf),
             "part_ptr": "*fp32", "slot_ptr": "*i64", "depth_ptr": "*i32", "wmask_ptr": "*i8"},
            {"BLOCK_M": 1, "BLOCK_N": 4, "BLOCK_K": 512, "PARTIAL": False, "SILU": False, "MODE": 0, "ROPE": True,
             "HEAD_D": 128, "KV_WRITE": True, "HAS_WMASK": False, "PAIRED": True, "PDL": False},
            {"num_warps": 4, "num_stages": 1},
        ),
    }  # fmt: skip
    out = {
        name: [fma_count(fn, ptrs, const, **opts, **EXACT_ROUNDING), fma_count(fn, ptrs, const, **opts)]
        for name, (fn, ptrs, const, opts) in cases.items()
    }
    print(json.dumps(out))


def attention_compiles() -> None:
    """Compile the tiled attention kernel for sm_90 with each KV dtype its KV_BITS serves (the
    interpreter runs Python, so a branch Triton cannot compile, such as a bitcast of a 16-bit K
    after a constexpr-if's return, shows only here): JSON {case: true}; an error raises."""
    from rlt_serve.attention import triton_backend as tb

    const = {"GROUP": 1, "GROUP_P": 16, "TOK_M": 16, "HEAD_D": 128, "HEAD_DP": 128, "BLOCK_N": 64, "PAGE_SIZE": 16,
             "PRECISION": "tf32", "SPLIT": True, "V_SCALE": 1.0, "FULL_FIRST": False, "PREFETCH": False,
             "PDL": False}  # fmt: skip
    # the prompt tile: unmasked blocks first; MHA 64 tokens x 64 keys, GQA 8 tokens x 8 heads x 32 keys, head_dim 96
    prompt = {"TOK_M": 64, "GROUP_P": 1, "FULL_FIRST": True, "SPLIT": False}
    gqa = {"GROUP": 6, "GROUP_P": 8, "TOK_M": 8, "BLOCK_N": 32, "HEAD_D": 96, "FULL_FIRST": True}
    done = {}
    for name, kv, bits in (("bf16", "*bf16", 0), ("e4m3", "*fp8e4nv", 1), ("e5m2", "*fp8e5", 2)):
        ptrs = {"q_ptr": "*bf16", "o_ptr": "*bf16", "k_cache": kv, "v_cache": kv, "part_acc": "*fp32",
                "part_ml": "*fp32", "rows_ptr": "*i32", "tiles_ptr": "*i32", "table_ptr": "*i32"}  # fmt: skip
        # decode rows: the first key block read before the PDL wait
        tiles = (("", {}), ("-prefetch", {"PREFETCH": True, "PDL": True}), ("-prompt", prompt), ("-prompt-gqa", gqa))
        for tile, extra in tiles:
            fma_count(tb._attention_kernel, ptrs, {**const, **extra, "KV_BITS": bits}, num_warps=4, num_stages=2)
            done[name + tile] = True
        vector = {"HEAD_D": 128, "HEAD_DP": 128, "BLOCK_N": 32, "PAGE_SIZE": 16, "SPLIT": True, "HEADS_FIRST": True,
                  "V_WITH_K": True, "PDL": True}  # fmt: skip
        for prefetch in (False, True):  # the vector decode kernel (float8 decode), first key block before the wait
            fma_count(tb._decode_mha_kernel, ptrs, {**vector, "PREFETCH": prefetch}, num_warps=1, num_stages=2)
            done[name + "-vector" + ("-prefetch" if prefetch else "")] = True
    print(json.dumps(done))


if __name__ == "__main__":
    import sys

    attention_compiles() if sys.argv[1:] == ["--attention"] else main()
