"""Backend selection rules, and the FlashAttention backend's plane/page plumbing on the CPU.

The flash kernels need CUDA, so here a small SDPA function with `flash_attn_varlen_func`'s
contract (bottom-right causal, optional `block_table` over a page pool) stands in for them:
that checks the plane-as-page offsets, the gathered path and the masked KV write, which are
the parts this project wrote. The real kernels are compared in tests/test_gpu.py.
"""

from __future__ import annotations


import pytest
import torch
import torch.nn.functional as F

from rlt_serve.attention.backend import get_attention_backend
from rlt_serve.attention.flash_backend import FlashAttentionBackend
from rlt_serve.attention.torch_backend import TorchAttentionBackend
from rlt_serve.config import ConfigError, EngineConfig
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.testing import random_attention_call

CPU = torch.device("cpu")


def test_auto_is_torch_on_cpu():
    backend = get_attention_backend("auto", CPU)
    assert backend.name == "torch" and "CPU" in backend.reason


def test_missing_backends_are_config_errors(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="triton"):
        get_attention_backend("triton", CPU)
    with pytest.raises(ConfigError, match="CUDA"):
        get_attention_backend("flash-attn", CPU)
    with pytest.raises(ConfigError, match="attention_backend"):
        EngineConfig(attention_backend="xformers").validate()


def test_engine_rejects_a_backend_that_cannot_run(tmp_checkpoint):
    path = tmp_checkpoint("ouro")
    with pytest.raises(ConfigError, match="flash-attn.*CUDA"):
        LLMEngine(path, device="cpu", skip_tokenizer_init=True, attention_backend="flash-attn")


def fake_flash_varlen(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale=None, causal=False, block_table=None):
    """SDPA per sequence with flash-attn's varlen contract."""
    out = torch.empty_like(q)
    for i in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[i]), int(cu_q[i + 1]), int(cu_k[i]), int(cu_k[i + 1])
        n_q, n_k = q1 - q0, k1 - k0
        if block_table is not None:
            keys = k[block_table[i].long()].flatten(0, 1)[:n_k]
            vals = v[block_table[i].long()].flatten(0, 1)[:n_k]
        else:
            keys, vals = k[k0:k1], v[k0:k1]
        mask = torch.arange(n_k)[None, :] <= torch.arange(n_k - n_q, n_k)[:, None]  # bottom-right
        o = F.scaled_dot_product_attention(q[q0:q1].transpose(0, 1), keys.transpose(0, 1), vals.transpose(0, 1),
                                           attn_mask=mask, scale=softmax_scale, enable_gqa=True)  # fmt: skip
        out[q0:q1] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("paged", [False, True])
@pytest.mark.parametrize("page_size,masked", [(1, False), (16, True), (4, True)])
def test_flash_plumbing_matches_torch(paged, page_size, masked):
    heads, kv_heads, head_dim = 6, 2, 16
    spans = [(1, 5), (7, 0), (1, 70), (20, 9), (3, 3)]
    pools, rows, (q, k, v), mask = random_attention_call(heads, kv_heads, head_dim, page_size, spans, 0, masked,
                                                         num_pages=200 // page_size + 8)  # fmt: skip
    ref, fa = TorchAttentionBackend(), FlashAttentionBackend(page_size, kernel=fake_flash_varlen, paged=paged)
    want = ref.forward(q, k, v, pools[0], 1, ref.prepare(rows, pools[0], mask), 0.3)  # layer 1: 3 depth slots
    got = fa.forward(q, k, v, pools[1], 1, fa.prepare(rows, pools[1], mask), 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v)
