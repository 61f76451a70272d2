"""The compiled decode GEMV on CUDA, bf16, at the real Ouro-1.4B and Nanbeige4.2 projection shapes.

Run with `pytest -m gpu -q tests/test_gemv_gpu.py`. cuBLAS and the GEMV sum K in different fp32
orders, so a result may round to the neighbouring bf16 value; beyond that they must agree.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rlt_serve.engine.cuda_graph import capture
from rlt_serve.models import fused_ops
from rlt_serve.models import gemv as gemv_mod
from rlt_serve.models.gemv import gemv

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (rows of W, K, silu): Ouro qkv, o, gate|up, down; Nanbeige qkv, o, gate|up, down
SHAPES = [
    (6144, 2048, False), (2048, 2048, False), (11264, 2048, True), (2048, 5632, False),
    (8192, 3072, False), (3072, 6144, False), (21504, 3072, True), (3072, 10752, False),
]  # fmt: skip


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """Worst difference in bf16 ulps of the reference; near zero (where sums cancel) in ulps of
    2^-12 of the largest output, the fp32 reduction-order noise scale."""
    w = want.float()
    ulp = (w.abs() * 2**-7).clamp_min(w.abs().max() * 2**-12)
    return ((got.float() - w).abs() / ulp).max().item()


@pytest.mark.parametrize("preload", ["0", "1"])
@pytest.mark.parametrize("rows,k,silu", SHAPES)
def test_gemv_matches_cublas_bf16(rows, k, silu, preload, monkeypatch):
    monkeypatch.setenv("RLT_GEMV_PRELOAD", preload)  # the tensor-core tiles' first W tile before the PDL wait
    g = torch.Generator(device="cuda").manual_seed(rows + k)
    w = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16, generator=g) * k**-0.5
    for m in range(1, gemv_mod.MAX_M + 1):
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=g)
        want = fused_ops.silu_mul(F.linear(x, w)) if silu else F.linear(x, w)
        got = gemv(x, w, silu=silu)
        assert got.shape == want.shape and got.dtype == torch.bfloat16
        assert _ulps(got, want) <= 2.0, (m, _ulps(got, want))  # gate and up may each round differently
        assert torch.equal(got, gemv(x, w, silu=silu)), "not deterministic"
    if not silu and k <= 6144:  # narrow tensor-core tiles at M=1 (RLT_GEMV_TILES candidates), split K too
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        for cfg in (gemv_mod.GemvConfig(16, 256, 1, 2, 4, 6), gemv_mod.GemvConfig(32, 256, 2, 2, 8, 4)):
            assert _ulps(gemv(x, w, config=cfg), F.linear(x, w)) <= 2.0, cfg


@pytest.mark.parametrize("heads,kv_heads,k", [(16, 16, 2048), (48, 8, 3072)])  # Ouro-1.4B, Nanbeige4.2
def test_qkv_epilogue_matches_rope_and_write_bf16(heads, kv_heads, k):
    """The compiled qkv epilogue (M = 1..8) against the GEMV, fused_ops' RoPE kernel and the cache
    write: the same roundings, but a half-height tile may sum K in another order, so within 2 ulps;
    the cache holds exactly what the epilogue returned for k and v."""
    from rlt_serve.attention.backend import KVWriteTarget
    from rlt_serve.models.gemv import QKVEpilogue, epilogue_fits

    d = 128
    g = torch.Generator(device="cuda").manual_seed(heads)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    w = torch.randn((heads + 2 * kv_heads) * d, k, generator=g, **bf) * k**-0.5
    for m in range(1, gemv_mod.MAX_M + 1):
        x = torch.randn(m, k, generator=g, **bf)
        cos, sin = torch.rand(m, d, generator=g, **bf), torch.rand(m, d, generator=g, **bf)
        caches = [torch.zeros(2, 16, kv_heads, d, **bf) for _ in range(2)]
        slot = torch.randperm(16, device="cuda")[:m]
        target = KVWriteTarget(*caches, slot, torch.ones(m, dtype=torch.long, device="cuda"), None, 0)
        epi = QKVEpilogue(cos, sin, heads, kv_heads, d, target)
        assert epilogue_fits(m, w, epi)
        got = gemv(x, w, epilogue=epi)
        q, kk, v = gemv(x, w).split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        q, kk = fused_ops.rope(q.reshape(m, heads, d), kk.reshape(m, kv_heads, d), cos[:, None], sin[:, None])
        assert _ulps(got, torch.cat([q.reshape(m, -1), kk.reshape(m, -1), v], dim=-1)) <= 2.0, m
        _, got_k, got_v = got.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
        assert torch.equal(caches[0][1, slot], got_k.reshape(m, kv_heads, d)), m
        assert torch.equal(caches[1][1, slot], got_v.reshape(m, kv_heads, d)), m


def test_gemv_graph_replay_equals_eager():
    """Captured in a CUDA graph (as the decode step is), the GEMV gives the eager results bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = {"device": "cuda", "dtype": torch.bfloat16}
    qkv, o = torch.randn(6144, 2048, generator=g, **bf), torch.randn(2048, 2048, generator=g, **bf)
    gu, down = torch.randn(11264, 2048, generator=g, **bf), torch.randn(2048, 5632, generator=g, **bf)
    for m in (1, 3, 8):
        x = torch.randn(m, 2048, generator=g, **bf)

        def step(x: torch.Tensor = x) -> tuple[torch.Tensor, ...]:
            a = gemv_mod.linear(x, qkv)
            b = gemv_mod.linear(a[:, :2048].contiguous(), o)
            u = gemv_mod.gate_up_silu(b, gu)
            c = gemv_mod.linear(u, down)
            return a, b, u, c

        graph, captured = capture(step)
        x.copy_(torch.randn(m, 2048, generator=g, **bf))  # the replay reads the new input
        eager = step()
        graph.replay()
        torch.cuda.synchronize()
        for got, want in zip(captured, eager):
            assert torch.equal(got, want), m


def test_dispatch_on_cuda(monkeypatch):
    """Decode-sized bf16 inputs take the GEMV; RLT_GEMV=0, more rows or fp32 take F.linear."""
    g = torch.Generator(device="cuda").manual_seed(1)
    w = torch.randn(6144, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    x = torch.randn(4, 256, device="cuda", dtype=torch.bfloat16, generator=g)
    assert gemv_mod.use_gemv(x, w)
    assert torch.equal(gemv_mod.linear(x, w), gemv(x, w))
    o = torch.randn(2048, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    xo = torch.randn(4, 2048, device="cuda", dtype=torch.bfloat16, generator=g)
    assert not gemv_mod.use_gemv(xo, o) and gemv_mod.use_gemv(xo[:1], o)  # see gemv.cublas_wins
    assert torch.equal(gemv_mod.linear(xo, o), F.linear(xo, o))
    assert not gemv_mod.use_gemv(torch.randn(gemv_mod.MAX_M + 1, 256, device="cuda", dtype=torch.bfloat16), w)
    assert not gemv_mod.use_gemv(x.float(), w.float())
    monkeypatch.setenv("RLT_GEMV", "0")
    assert not gemv_mod.use_gemv(x, w)
    assert torch.equal(gemv_mod.linear(x, w), F.linear(x, w))


@pytest.mark.parametrize(
    "family,options",
    [("ouro", ""), ("nanbeige", ""), ("huginn", ""), ("ouro", "RLT_QKV_EPILOGUE=0")],
)  # fmt: skip
def test_engine_bf16_decode_gemv_matches_cublas(tmp_checkpoint, monkeypatch, family, options):
    """Whole engine, bf16, graphs on, concurrency 1 and 8: decode through the GEMV (RoPE + K/V
    write in the qkv epilogue unless turned off) gives cuBLAS's tokens and logprobs up to the
    first token a bf16 near-tie may flip."""
    from test_gpu import SHAPES as ENGINE_SHAPES
    from test_gpu import _steady_decode

    path = tmp_checkpoint(family, seed=7, dtype="bfloat16", **ENGINE_SHAPES.get(family, {}))
    for concurrency in (1, 8):
        monkeypatch.setenv("RLT_GEMV", "0")
        want, _ = _steady_decode(path, "bfloat16", concurrency)
        monkeypatch.setenv("RLT_GEMV", "1")
        with monkeypatch.context() as mp:
            for option in options.split():
                mp.setenv(*option.split("="))
            got, engine = _steady_decode(path, "bfloat16", concurrency)
        assert engine.stats().num_cuda_graph_replays > 0
        assert got.keys() == want.keys()
        for rid, (tokens, logprobs) in want.items():
            same = next((i for i, (a, b) in enumerate(zip(tokens, got[rid][0])) if a != b), len(tokens))
            assert max(abs(a - b) for a, b in zip(logprobs[: same + 1], got[rid][1][: same + 1])) < 0.05, rid
