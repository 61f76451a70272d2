"""The decode GEMV (rlt_serve.models.gemv) against torch, run by Triton's CPU interpreter.

fp16 and float32, tiny shapes: the interpreter's bf16 casts truncate instead of rounding (and its
bf16 tl.dot is broken), while its fp16 is numpy's, which rounds to nearest like the GPU. Shapes
are not multiples of the tiles, so the N and K tails and the split-K ranges are all exercised.
Triton reads TRITON_INTERPRET when first imported: set here at collection, as in
tests/test_triton_interpret.py, and only where no CUDA device exists (tests/test_gemv_gpu.py
runs the compiled kernels there).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from triton_interpreter import select as select_interpreter

select_interpreter("tests/test_gemv_gpu.py")

pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

from rlt_serve.models import gemv as gemv_mod
from rlt_serve.models.gemv import GemvConfig, gemv

# (block_n, block_k, split_k, mode): elementwise (M=1), x @ W^T, W @ x^T; whole K and split K
CONFIGS = [
    GemvConfig(16, 64, 1, 0), GemvConfig(8, 32, 3, 0), GemvConfig(16, 32, 1, 1), GemvConfig(32, 32, 2, 2),
    GemvConfig(16, 64, 4, 1), GemvConfig(8, 1024, 1, 0, 8, 1), GemvConfig(128, 64, 1, 2, 4, 5),
]  # fmt: skip


def _want(x: torch.Tensor, w: torch.Tensor, silu: bool) -> torch.Tensor:
    """F.linear rounded once from an exact sum, then (with silu) fused_ops.silu_mul's rounding."""
    y = (x.double() @ w.double().T).to(x.dtype)
    if not silu:
        return y
    gate, up = y.chunk(2, dim=-1)
    return F.silu(gate) * up


def _assert_rounded_like(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp16: every output within one ulp of the exactly-summed, once-rounded value, and almost all
    equal to it (an fp32 sum differs from the exact one by ~1e-6 relative, so only values near a
    rounding boundary may land on the other side; a second rounding or a truncation would move
    about half of them)."""
    diff = (got.float() - want.float()).abs()
    ulp = torch.exp2(torch.floor(torch.log2(want.float().abs().clamp_min(2**-14))) - 10)
    assert (diff <= ulp).all(), (diff / ulp).max()
    assert (diff == 0).float().mean() >= 0.98, (diff == 0).float().mean()


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: f"n{c.block_n}k{c.block_k}s{c.split_k}m{c.mode}")
@pytest.mark.parametrize("silu", [False, True], ids=["linear", "silu"])
def test_gemv_matches_torch(cfg, silu):
    g = torch.Generator().manual_seed(cfg.block_n * 7 + cfg.mode + silu)
    ms = [1] if cfg.mode == 0 else [1, 2, 5, 8]
    for dtype in (torch.float16, torch.float32):
        for m in ms:
            n, k = (2 * 37, 150) if silu else (45, 167)  # neither a multiple of any tile
            x = torch.randn(m, k, generator=g).to(dtype)
            w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
            got, want = gemv(x, w, silu=silu, config=cfg), _want(x, w, silu)
            assert got.shape == want.shape and got.dtype == dtype
            if dtype == torch.float16:
                _assert_rounded_like(got, want)
            else:
                torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("cfg", [GemvConfig(16, 64, 1, 0), GemvConfig(8, 32, 2, 0), GemvConfig(16, 32, 3, 2)])
def test_tails_are_not_dropped(cfg):
    """W is zero except in the last K column and the last N row: a kernel that skipped either
    tail (K = 150 is no multiple of 32 or 64, N = 45 none of 8 or 16) would return zeros there."""
    k, n = 150, 45
    x = torch.ones(1, k)
    w = torch.zeros(n, k)
    w[:, -1] = 2.0  # only the K tail contributes to every output
    w[-1, :] = 1.0  # the last row, in the N tail, sums all of x (its K tail included)
    got = gemv(x, w, config=cfg)
    want = torch.full((1, n), 2.0)
    want[0, -1] = float(k)
    assert torch.equal(got, want), got
    gu = torch.cat([w, w])  # gate == up: silu(y) * y, tails included
    y = want
    assert torch.allclose(gemv(x, gu, silu=True, config=cfg), F.silu(y) * y)


def test_default_configs_cover_every_m():
    """The tiles the engine would pick for decode-sized inputs (M = 1..8), on a gate|up-like and
    two o_proj-like shapes (K in one tile and in several), whole K and split K alike."""
    g = torch.Generator().manual_seed(3)
    for m in range(1, gemv_mod.MAX_M + 1):
        for n, k, silu in ((2 * 40, 96, True), (48, 2100, False), (24, 2000, False)):
            cfg = gemv_mod.default_config(m, n // 2 if silu else n, k, silu)
            x = torch.randn(m, k, generator=g).half()
            w = (torch.randn(n, k, generator=g) * k**-0.5).half()
            _assert_rounded_like(gemv(x, w, silu=silu, config=cfg), _want(x, w, silu))


def test_wider_rows_under_rlt_gemv_max_m(monkeypatch):
    """RLT_GEMV_MAX_M opens the GEMV to decode batches past MAX_M (capped at 64) for measurement:
    dispatch follows it, and the tile it picks there is exact for 9..64 rows, a qkv epilogue fits."""
    from rlt_serve.models.gemv import QKVEpilogue, epilogue_fits

    monkeypatch.setenv("RLT_GEMV", "interpret")
    g = torch.Generator().manual_seed(6)
    w = (torch.randn(96, 80, generator=g) * 80**-0.5).half()
    assert gemv_mod.max_m() == gemv_mod.MAX_M
    assert not gemv_mod.use_gemv(torch.randn(9, 80).half(), w, silu=True)  # gate|up: cuBLAS never wins
    monkeypatch.setenv("RLT_GEMV_MAX_M", "128")
    assert gemv_mod.max_m() == 64
    assert gemv_mod.use_gemv(torch.randn(64, 80).half(), w, silu=True)
    assert not gemv_mod.use_gemv(torch.randn(65, 80).half(), w, silu=True)
    for m in (9, 33, 64):
        x = torch.randn(m, 80, generator=g).half()
        for silu in (False, True):
            cfg = gemv_mod.default_config(m, 48 if silu else 96, 80, silu)
            _assert_rounded_like(gemv(x, w, silu=silu, config=cfg), _want(x, w, silu))
    cos = sin = torch.ones(64, 128).half()  # Ouro's head_dim: the tile's 32 pairs divide its 64
    assert epilogue_fits(64, torch.empty(4 * 128 + 2 * 2 * 128, 80), QKVEpilogue(cos, sin, 4, 2, 128, None))


def test_rlt_gemv_tiles_overrides_m1_tiles(monkeypatch):
    """RLT_GEMV_TILES picks the tile of one weight shape at M=1 (others and M>1 keep the defaults),
    the narrow tensor-core tile it names is exact, and a malformed entry is a clear error."""
    g = torch.Generator().manual_seed(8)
    monkeypatch.setenv("RLT_GEMV_TILES", "96x80=16,32,1,2,4,3; 48x80:silu=32,32,1,2,4,2")
    assert gemv_mod.default_config(1, 96, 80, False) == GemvConfig(16, 32, 1, 2, 4, 3)
    assert gemv_mod.default_config(1, 48, 80, True) == GemvConfig(32, 32, 1, 2, 4, 2)
    monkeypatch.delenv("RLT_GEMV_TILES")
    defaults = gemv_mod.default_config(1, 96, 80, False), gemv_mod.default_config(2, 96, 80, False)
    monkeypatch.setenv("RLT_GEMV_TILES", "96x80=16,32,1,2,4,3")
    assert gemv_mod.default_config(2, 96, 80, False) == defaults[1]
    assert gemv_mod.default_config(1, 96, 81, False) != GemvConfig(16, 32, 1, 2, 4, 3)
    x = torch.randn(1, 80, generator=g).half()
    w = (torch.randn(96, 80, generator=g) * 80**-0.5).half()
    _assert_rounded_like(gemv(x, w), _want(x, w, False))
    assert defaults[0] != GemvConfig(16, 32, 1, 2, 4, 3)
    monkeypatch.setenv("RLT_GEMV_TILES", "96x80=16,32")
    with pytest.raises(ValueError, match="RLT_GEMV_TILES"):
        gemv_mod.default_config(1, 96, 80, False)


def test_bad_shapes_are_rejected():
    with pytest.raises(ValueError, match="do not fit"):
        gemv(torch.ones(1, 8), torch.ones(4, 9))
    with pytest.raises(ValueError, match="do not fit"):
        gemv(torch.ones(1, 8), torch.ones(5, 8), silu=True)
    with pytest.raises(ValueError, match="one row"):
        gemv(torch.ones(2, 8), torch.ones(4, 8), config=GemvConfig(16, 64, 1, 0))


def test_cublas_keeps_short_narrow_weights_at_several_rows():
    """Measured on the H200: Ouro's o_proj / down at M > 1 stay with cuBLAS; M = 1 and wide or
    long weights take the GEMV."""
    assert gemv_mod.cublas_wins(2, 2048, 2048) and gemv_mod.cublas_wins(8, 2048, 5632)
    assert not gemv_mod.cublas_wins(1, 2048, 2048)
    assert not gemv_mod.cublas_wins(4, 6144, 2048)  # qkv
    assert not gemv_mod.cublas_wins(4, 3072, 6144)  # Nanbeige o_proj


def test_dispatch_keeps_torch_off_cuda(monkeypatch):
    """On the CPU (interpreting or not) the layers' helpers are F.linear and silu_mul exactly."""
    g = torch.Generator().manual_seed(4)
    x, w = torch.randn(2, 16, generator=g), torch.randn(12, 16, generator=g)
    assert not gemv_mod.use_gemv(x, w)
    assert torch.equal(gemv_mod.linear(x, w), F.linear(x, w))
    gate, up = F.linear(x, w).chunk(2, dim=-1)
    assert torch.equal(gemv_mod.gate_up_silu(x, w), F.silu(gate) * up)


def _close_fp32(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-6, atol=1e-6))


@pytest.mark.parametrize("cfg", [GemvConfig(8, 64, 1, 0), GemvConfig(4, 32, 1, 0), GemvConfig(32, 32, 1, 2)],
                         ids=lambda c: f"n{c.block_n}k{c.block_k}m{c.mode}")  # fmt: skip
@pytest.mark.parametrize("masked", [False, True], ids=["all-write", "write-mask"])
def test_qkv_epilogue_equals_rope_then_write(cfg, masked):
    """The qkv GEMV with its epilogue: q and k rotated exactly as fused_ops' RoPE rotates the
    unfused projection (rounding included), v untouched, and K/V in each token's slot of its depth
    plane, where the write mask allows; every other cache entry keeps its value."""
    from rlt_serve.attention.backend import KVWriteTarget
    from rlt_serve.models import fused_ops
    from rlt_serve.models.gemv import QKVEpilogue, epilogue_fits

    heads, kv_heads, d, k = 4, 2, 32, 150  # GQA; K not a multiple of the tile
    g = torch.Generator().manual_seed(5 + cfg.mode + masked)
    for dtype in (torch.float16, torch.float32):
        n = (heads + 2 * kv_heads) * d
        w = (torch.randn(n, k, generator=g) * k**-0.5).to(dtype)
        for m in [1] if cfg.mode == 0 else [1, 3, 8]:
            x = torch.randn(m, k, generator=g).to(dtype)
            pos = torch.randint(0, 50, (m,), generator=g)
            freqs = pos.float()[:, None] * (1.0 / 1e4 ** (torch.arange(0, d, 2).float() / d))[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
            planes, slots = 3, 20
            k_cache = torch.randn(planes, slots, kv_heads, d, generator=g).to(dtype)
            v_cache = torch.randn(planes, slots, kv_heads, d, generator=g).to(dtype)
            slot = torch.randperm(slots, generator=g)[:m]
            depth = torch.randint(0, 2, (m,), generator=g)
            wmask = (torch.arange(m) % 2 == 0).to(torch.int8) if masked else None
            target = KVWriteTarget(k_cache.clone(), v_cache.clone(), slot, depth, wmask, 1)
            epi = QKVEpilogue(cos, sin, heads, kv_heads, d, target)
            assert epilogue_fits(m, w, epi, cfg)
            got = gemv(x, w, config=cfg, epilogue=epi)
            want = gemv(x, w, config=cfg)
            q, kk, v = want.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
            q, kk = (fused_ops.rope_torch(t.reshape(m, -1, d), cos[:, None], sin[:, None]) for t in (q, kk))
            v = v.reshape(m, kv_heads, d)
            # float32 keeps the sums' last bit, which depends on the two GEMVs' tilings and on the
            # BLAS the interpreter's dots run on (seen differing by 1 ulp on one CPU): close, not equal
            same = torch.equal if dtype == torch.float16 else _close_fp32
            assert same(got, torch.cat([q.reshape(m, -1), kk.reshape(m, -1), v.reshape(m, -1)], dim=-1))
            for i in range(m):
                if wmask is None or wmask[i]:
                    k_cache[1 + depth[i], slot[i]], v_cache[1 + depth[i], slot[i]] = kk[i], v[i]
            assert same(target.k_cache, k_cache) and same(target.v_cache, v_cache)
    w_bad = torch.randn((heads + 2 * kv_heads) * d + 1, k)
    with pytest.raises(ValueError, match="epilogue does not fit"):
        gemv(torch.randn(1, k), w_bad, config=cfg if cfg.mode else None, epilogue=epi)
