"""The reference oracle on shapes the golden cases do not cover, and its self-consistency."""

from __future__ import annotations

import random

import pytest
import torch

from rlt_serve import reference
from rlt_serve.config import ConfigError
from rlt_serve.reference import ReferenceModel, rope_cos_sin, rotate_half

OTHER_SHAPES = dict(num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2, head_dim=24)


def _ids(n: int, vocab: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, vocab) for _ in range(n)]


@pytest.mark.parametrize("family,loops", [("ouro", {"total_ut_steps": 3}), ("nanbeige", {"num_loops": 3})])
def test_other_shapes_run_and_use_rope(tmp_checkpoint, monkeypatch, family, loops):
    ref = ReferenceModel.from_pretrained(tmp_checkpoint(family, seed=4, **OTHER_SHAPES, **loops))
    cfg = ref.config
    assert (cfg.num_loops, cfg.head_dim, cfg.num_key_value_heads) == (3, 24, 2)
    ids = _ids(40, cfg.vocab_size)
    out = ref.forward(ids)
    assert out.logits.shape == (40, cfg.vocab_size) and out.logits.dtype == torch.float32
    assert out.loop_hidden.shape == (3, 40, cfg.hidden_size)
    assert torch.isfinite(out.logits).all()
    if family == "ouro":
        assert out.gate_logits.shape == out.exit_pdf.shape == (40, 3)
        torch.testing.assert_close(out.exit_pdf.sum(-1), torch.ones(40))
    else:
        assert out.gate_logits is None and out.exit_pdf is None

    # Position matters: with RoPE replaced by the identity the logits move well beyond fp32 noise.
    def no_rope(n, d, theta, dtype):
        return torch.ones(n, d, dtype=dtype), torch.zeros(n, d, dtype=dtype)

    monkeypatch.setattr(reference, "rope_cos_sin", no_rope)
    flat = ref.forward(ids).logits
    assert (flat[0] - out.logits[0]).abs().max() < 1e-6  # position 0 is not rotated
    assert (flat[1:] - out.logits[1:]).abs().max() > 1e-3


def test_rope_scores_depend_on_relative_position():
    cos, sin = rope_cos_sin(64, 24, 10000.0, torch.float32)
    q, k = torch.randn(24, dtype=torch.float64), torch.randn(24, dtype=torch.float64)

    def score(m: int, n: int) -> float:
        c, s = cos.double(), sin.double()
        return float((q * c[m] + rotate_half(q) * s[m]) @ (k * c[n] + rotate_half(k) * s[n]))

    assert score(7, 3) == pytest.approx(score(40, 36), abs=1e-5)
    assert abs(score(7, 3) - score(7, 6)) > 1e-3


@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_greedy_equals_forward_on_extended_sequence(tmp_checkpoint, family):
    ref = ReferenceModel.from_pretrained(tmp_checkpoint(family, seed=5))
    prompt = _ids(9, ref.config.vocab_size, seed=1)
    tokens, logits = ref.greedy(prompt, 6)
    assert len(tokens) == 6 and logits.shape == (6, ref.config.vocab_size)
    full = ref.forward(prompt + tokens[:-1]).logits
    torch.testing.assert_close(logits, full[len(prompt) - 1 :], atol=1e-5, rtol=0)
    assert tokens == full[len(prompt) - 1 :].argmax(-1).tolist()
    # Causal: a prefix's logits do not depend on what follows it.
    torch.testing.assert_close(ref.forward(prompt).logits, full[: len(prompt)], atol=1e-5, rtol=0)
    assert ref.greedy(prompt, 0)[0] == []


def test_ouro_any_depth(tmp_checkpoint):
    """Ouro may run more or fewer loops than total_ut_steps; loop u's state never depends on later loops."""
    ref = ReferenceModel.from_pretrained(tmp_checkpoint("ouro", seed=6))
    ids = _ids(12, ref.config.vocab_size)
    deep = ref.forward(ids, num_loops=6)
    for loops in (1, 2, 4):
        out = ref.forward(ids, num_loops=loops)
        torch.testing.assert_close(out.loop_hidden, deep.loop_hidden[:loops], atol=1e-6, rtol=0)
        assert out.exit_pdf.shape == (12, loops)
    torch.testing.assert_close(ref.loop_logits(deep)[-1], deep.logits)
    with pytest.raises(ConfigError):
        ref.forward(ids, num_loops=0)


def test_nanbeige_depth_is_fixed(tmp_checkpoint):
    ref = ReferenceModel.from_pretrained(tmp_checkpoint("nanbeige"))
    ref.forward([3, 4], num_loops=2)
    with pytest.raises(ConfigError, match="nanbeige"):
        ref.forward([3, 4], num_loops=3)


def test_tied_embeddings(tmp_checkpoint):
    ref = ReferenceModel.from_pretrained(tmp_checkpoint("nanbeige", tie_word_embeddings=True))
    out = ref.forward([5, 6, 7])
    h = out.loop_hidden[-1]
    torch.testing.assert_close(out.logits, h @ ref.weights["model.embed_tokens.weight"].T)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_close_to_fp32(tmp_checkpoint, dtype):
    path = tmp_checkpoint("ouro", seed=8)
    ids = _ids(30, 384)
    fp32 = ReferenceModel.from_pretrained(path).forward(ids)
    low = ReferenceModel.from_pretrained(path, dtype=dtype).forward(ids)
    assert low.loop_hidden.dtype == dtype and low.logits.dtype == low.exit_pdf.dtype == torch.float32
    assert (low.logits - fp32.logits).abs().max() < 5e-2
