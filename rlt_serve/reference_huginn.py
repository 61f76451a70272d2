"""The dense Huginn-0125 reference: the oracle the engine's Huginn path is compared against.

Written from MODELS.md §3 and the golden README, independent of `rlt_serve.models` and the
engine (the initial-state noise rule is restated here on purpose). Batch 1, no paging.
- `forward` / `greedy`: every token runs the same steps ("full" cache), so the whole sequence is
  recomputed densely through prelude, r core steps, coda: the official forward without a cache.
- `generate`: token by token against plain per-(layer, step) lists of earlier tokens' K/V, for
  the semantics that depend on what an earlier token left behind: the cache strategies
  (`latest-m4`: an earlier token is read at min(step, its exit step); `compress-s{k}`: at its
  latest step with the same ring slot) and the exit criteria, run plainly after each step as
  the official evaluators do. Prompt positions run every step; generated ones may exit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from rlt_serve.config import ConfigError, ModelConfig, compress_ring
from rlt_serve.loader import load_state_dict
from rlt_serve.reference import stored_kv

_MASK64 = (1 << 64) - 1
KV = tuple[torch.Tensor, torch.Tensor]  # [H, d] key and value of one position


def _noise_seed(seed: int, position: int) -> int:
    """splitmix64 of (request seed, position): the engine's rule for a token's initial-state draw."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


@dataclass
class HuginnOutput:
    logits: torch.Tensor  # [S, V] fp32
    latents: torch.Tensor  # [S, H] ln_f of the last core step (the official `latent_states`)


@dataclass
class Generation:
    tokens: list[int]
    logits: torch.Tensor  # [G, V] fp32; row k produced tokens[k]
    exit_steps: list[int]  # per position of prompt + generated[:-1]: the 0-based step it left the core at
    # per generated position: [(step, criterion value)] for every check made (for threshold margins)
    checks: list[list[tuple[int, float]]] = field(default_factory=list)


class HuginnReference:
    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        self.config, self.w, self.dtype = config, weights, dtype
        self.kv_dtype = kv_dtype  # as ReferenceModel's: K/V read back from a cache of this dtype
        c = config
        self.inv_freq = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim)

    @classmethod
    def from_pretrained(
        cls, model_dir: str, dtype: torch.dtype = torch.float32, hf_overrides: dict[str, Any] | None = None
    ) -> "HuginnReference":
        config = ModelConfig.from_pretrained(model_dir, hf_overrides)
        if config.model_type != "huginn_raven":
            raise ConfigError(f"{model_dir}: not a Huginn checkpoint ({config.model_type})")
        weights = load_state_dict(model_dir, keys=cls.weight_keys(config), dtype=dtype)
        weights.setdefault("lm_head.weight", weights["transformer.wte.weight"])  # tied
        return cls(config, weights, dtype)

    @staticmethod
    def weight_keys(c: ModelConfig) -> list[str]:
        """What the forward reads (MODELS.md §3.8): not `freqs_cis`, and the tied head is the embedding."""
        keys = ["transformer.wte.weight", "transformer.adapter.weight", "transformer.ln_f.weight"]
        groups = [("prelude", c.num_prelude_layers), ("core_block", c.num_hidden_layers), ("coda", c.num_coda_layers)]
        for name, n in groups:
            for i in range(n):
                p = f"transformer.{name}.{i}."
                keys += [p + f"norm_{k}.weight" for k in (1, 2, 3, 4)]
                keys += [p + "attn.Wqkv.weight", p + "attn.proj.weight", p + "mlp.fc.weight", p + "mlp.proj.weight"]
                keys += [p + "attn.qk_bias"] if c.qk_bias else []
        return keys + ([] if c.tie_word_embeddings else ["lm_head.weight"])

    # -- pieces -------------------------------------------------------------------------------
    def _norm(self, x: torch.Tensor, key: str) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.rms_norm_eps)).to(x.dtype) * self.w[key]

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Interleaved pairs (2i, 2i+1) rotated by fp32 angles; x [S, heads, d]."""
        ang = positions.float()[:, None] * self.inv_freq[None, :]
        cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
        xf = x.float().unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2).to(x.dtype)

    def _qkv(self, p: str, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        c = self.config
        q, k, v = F.linear(x, self.w[p + "attn.Wqkv.weight"]).view(x.shape[0], 3, c.num_attention_heads, c.head_dim).unbind(1)
        if c.qk_bias:  # added before RoPE
            q, k = q + self.w[p + "attn.qk_bias"][0, 0], k + self.w[p + "attn.qk_bias"][1, 0]
        return self._rope(q, positions), stored_kv(self._rope(k, positions), self.kv_dtype), stored_kv(v, self.kv_dtype)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> torch.Tensor:
        """q [Sq, H, d] against k, v [Sk, H, d]; with `causal`, query i sees keys <= i + Sk - Sq."""
        scores = torch.einsum("qhd,khd->hqk", q, k) * self.config.head_dim**-0.5
        if causal:
            sq, sk = q.shape[0], k.shape[0]
            mask = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
            scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        return torch.einsum("hqk,khd->qhd", probs, v).reshape(q.shape[0], -1)

    def _finish_block(self, p: str, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """Sandwich: norm_2(attn + x), then norm_4(mlp(norm_3 x) + x); gated MLP with fc rows gate|up."""
        x = self._norm(F.linear(attn, self.w[p + "attn.proj.weight"]) + x, p + "norm_2.weight")
        gate, up = F.linear(self._norm(x, p + "norm_3.weight"), self.w[p + "mlp.fc.weight"]).chunk(2, dim=-1)
        return self._norm(F.linear(F.silu(gate) * up, self.w[p + "mlp.proj.weight"]) + x, p + "norm_4.weight")

    def _block(self, p: str, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        q, k, v = self._qkv(p, self._norm(x, p + "norm_1.weight"), positions)
        return self._finish_block(p, x, self._attend(q, k, v, causal=True))

    def _embed(self, ids: list[int]) -> torch.Tensor:
        return self.w["transformer.wte.weight"][torch.as_tensor(ids, dtype=torch.long)] * self.config.embed_scale

    def _adapt(self, x: torch.Tensor, e: torch.Tensor) -> torch.Tensor:
        return F.linear(torch.cat([x, e], dim=-1), self.w["transformer.adapter.weight"])  # state first

    def _head(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, "transformer.ln_f.weight"), self.w["lm_head.weight"]).float()

    def initial_state(self, positions: list[int], seed: int) -> torch.Tensor:
        """trunc-normal(0, σ, ±3σ)·√H per token, σ = init_std·init_scale, seeded by (seed, position)."""
        c = self.config
        std = c.init_std * c.init_scale
        x = torch.zeros(len(positions), c.hidden_size, dtype=torch.float32)
        if std > 0:
            for i, pos in enumerate(positions):
                gen = torch.Generator().manual_seed(_noise_seed(seed, pos))
                torch.nn.init.trunc_normal_(x[i], 0.0, std, -3 * std, 3 * std, generator=gen)
        return (x * c.embed_scale).to(self.dtype)

    def _steps(self, num_steps: int | None) -> int:
        steps = self.config.num_loops if num_steps is None else num_steps
        if steps < 1:
            raise ConfigError(f"num_steps must be >= 1, got {steps}")
        return steps

    # -- fixed depth, dense -------------------------------------------------------------------
    @torch.no_grad()
    def forward(self, ids: list[int], num_steps: int | None = None, seed: int = 0) -> HuginnOutput:
        """Every position through prelude, `num_steps` core steps (default mean_recurrence), coda."""
        c, steps = self.config, self._steps(num_steps)
        pos = torch.arange(len(ids))
        e = self._embed(ids)
        for i in range(c.num_prelude_layers):
            e = self._block(f"transformer.prelude.{i}.", e, pos)
        x = self.initial_state(list(range(len(ids))), seed)
        for _ in range(steps):
            x = self._adapt(x, e)
            for j in range(c.num_hidden_layers):
                x = self._block(f"transformer.core_block.{j}.", x, pos)
        latents = self._norm(x, "transformer.ln_f.weight")
        y = latents
        for i in range(c.num_coda_layers):
            y = self._block(f"transformer.coda.{i}.", y, pos)
        return HuginnOutput(self._head(y), latents)

    def greedy(
        self, ids: list[int], max_tokens: int, num_steps: int | None = None, seed: int = 0
    ) -> tuple[list[int], torch.Tensor]:
        """Argmax decode by full recomputation; row k of the logits [G, V] produced token k."""
        seq, tokens, rows = list(ids), [], []
        for _ in range(max_tokens):
            row = self.forward(seq, num_steps, seed).logits[-1]
            rows.append(row)
            tokens.append(int(row.argmax()))
            seq.append(tokens[-1])
        return tokens, torch.stack(rows)

    # -- token by token: cache strategies and exit criteria -----------------------------------
    @torch.no_grad()
    def generate(
        self,
        prompt: list[int],
        max_tokens: int,
        num_steps: int | None = None,
        seed: int = 0,
        cache: str = "full",
        criterion: str | None = None,
        threshold: float | None = None,
        min_loops: int = 1,
        check_interval: int = 1,
    ) -> Generation:
        """Greedy decode, one position at a time, under a cache strategy and an exit criterion."""
        c, steps = self.config, self._steps(num_steps)
        ring = compress_ring(cache)
        ring = ring // c.num_hidden_layers if ring is not None else None
        if cache not in ("full", "latest-m4") and ring is None:
            raise ConfigError(f"unknown cache strategy {cache!r}")
        pre_kv: list[list[KV]] = [[] for _ in range(c.num_prelude_layers)]
        core_kv: list[list[list[KV]]] = [[] for _ in range(c.num_hidden_layers)]  # [layer][pos][step]
        coda_kv: list[list[KV]] = [[] for _ in range(c.num_coda_layers)]
        ids, gen = list(prompt), Generation([], torch.empty(0), [])
        rows: list[torch.Tensor] = []
        t = 0
        while len(gen.tokens) < max_tokens:
            pos = torch.tensor([t])
            e = self._embed([ids[t]])
            for i in range(c.num_prelude_layers):
                e = self._cached_block(f"transformer.prelude.{i}.", e, pos, pre_kv[i], store=True)
            x = self.initial_state([t], seed)
            decide = criterion is not None and t >= len(prompt)
            judge = _Criterion(criterion, threshold, x) if decide else None
            own: list[list[KV]] = [[] for _ in range(c.num_hidden_layers)]
            exit_step = steps - 1
            for s in range(steps):
                x = self._adapt(x, e)
                for j in range(c.num_hidden_layers):
                    earlier = [self._read(kv, s, cache, ring) for kv in core_kv[j]]
                    x = self._core_block(j, x, pos, earlier, own[j])
                first = min_loops - 1
                if judge is not None and s + 1 < steps and s >= first and (s - first) % check_interval == 0:
                    logits = self._coda_logits(x, pos, coda_kv, store=False) if judge.needs_logits else None
                    if judge.check(x, logits, s):
                        exit_step = s
                        break
            for j in range(c.num_hidden_layers):
                core_kv[j].append(own[j])
            gen.exit_steps.append(exit_step)
            if judge is not None:
                gen.checks.append(judge.values)
            row = self._coda_logits(x, pos, coda_kv, store=True)
            if t >= len(prompt) - 1:
                rows.append(row)
                gen.tokens.append(int(row.argmax()))
                ids.append(gen.tokens[-1])
            t += 1
        gen.exit_steps = gen.exit_steps[: len(ids) - 1]
        gen.logits = torch.stack(rows) if rows else torch.empty(0, c.vocab_size)
        return gen

    def _read(self, steps_kv: list[KV], s: int, cache: str, ring: int | None) -> KV:
        """Which step of an earlier token a query at step s reads, per strategy."""
        last = len(steps_kv) - 1
        if ring is not None:  # latest write that hashed to the same ring slot
            return steps_kv[s % ring + ring * ((last - s % ring) // ring)]
        if cache == "latest-m4":
            return steps_kv[min(s, last)]
        if s > last:
            raise ConfigError("cache 'full' cannot read a step an earlier token never ran; use latest-m4")
        return steps_kv[s]

    def _cached_block(self, p: str, x: torch.Tensor, pos: torch.Tensor, kv: list[KV], store: bool) -> torch.Tensor:
        q, k, v = self._qkv(p, self._norm(x, p + "norm_1.weight"), pos)
        keys = torch.stack([a for a, _ in kv] + [k[0]])
        vals = torch.stack([b for _, b in kv] + [v[0]])
        if store:
            kv.append((k[0], v[0]))
        return self._finish_block(p, x, self._attend(q, keys, vals, causal=False))

    def _core_block(self, j: int, x: torch.Tensor, pos: torch.Tensor, earlier: list[KV], own: list[KV]) -> torch.Tensor:
        p = f"transformer.core_block.{j}."
        q, k, v = self._qkv(p, self._norm(x, p + "norm_1.weight"), pos)
        own.append((k[0], v[0]))
        keys = torch.stack([a for a, _ in earlier] + [k[0]])
        vals = torch.stack([b for _, b in earlier] + [v[0]])
        return self._finish_block(p, x, self._attend(q, keys, vals, causal=False))

    def _coda_logits(self, x: torch.Tensor, pos: torch.Tensor, coda_kv: list[list[KV]], store: bool) -> torch.Tensor:
        """ln_f, coda blocks (reading earlier tokens' coda K/V), ln_f, head: logits [V] of this token."""
        y = self._norm(x, "transformer.ln_f.weight")
        for i in range(self.config.num_coda_layers):
            y = self._cached_block(f"transformer.coda.{i}.", y, pos, coda_kv[i], store)
        return self._head(y)[0]


_AUTO = {"kl": 1e-3, "minp-kl": 1e-5, "entropy-diff": 1e-3, "latent-diff": 0.03, "cosine": 1e-3, "argmax-stability": 5}


class _Criterion:
    """One token's official exit evaluator (`init` on the initial state, `check` after a step)."""

    def __init__(self, name: str, threshold: float | None, initial: torch.Tensor) -> None:
        if name not in _AUTO:
            raise ConfigError(f"unknown exit criterion {name!r}")
        self.name, self.thr = name, _AUTO[name] if threshold is None else threshold
        self.needs_logits = name not in ("latent-diff", "cosine")
        # Before the first check: uniform (KL rules), entropy 100, argmax -1, or the initial state.
        self.prev: Any = {"kl": None, "minp-kl": None, "entropy-diff": 100.0, "argmax-stability": -1}.get(
            name, initial.float()[0]
        )
        self.stable = 0
        self.values: list[tuple[int, float]] = []

    def check(self, x: torch.Tensor, logits: torch.Tensor | None, step: int) -> bool:
        name, x = self.name, x.float()[0]
        if name == "latent-diff":
            value = float((x - self.prev).norm() / x.norm())
            self.prev = x
        elif name == "cosine":
            value = float(1 - (x * self.prev).sum() / x.norm() / self.prev.norm())
            self.prev = x
        elif name == "argmax-stability":
            top = int(logits.argmax())
            self.stable = self.stable + 1 if top == self.prev else 0
            self.prev = top
            self.values.append((step, float(self.stable)))
            return self.stable >= int(self.thr)
        elif name == "entropy-diff":
            probs = torch.softmax(logits, -1)
            entropy = float(-(probs * torch.log(probs + 1e-10)).sum())
            value, self.prev = abs(entropy - self.prev), entropy
        else:
            probs = torch.softmax(logits, -1)
            if name == "minp-kl":  # below 0.1·max → 1/V, renormalised
                probs = torch.where(probs < 0.1 * probs.max(), torch.full_like(probs, 1 / probs.numel()), probs)
                probs = probs / probs.sum()
            log_p = probs.log() if name == "minp-kl" else torch.log_softmax(logits, -1)
            prev = torch.full_like(log_p, -math.log(log_p.numel())) if self.prev is None else self.prev
            value = float((prev.exp() * (prev - log_p)).sum())  # KL(p_prev || p_t)
            self.prev = log_p
        self.values.append((step, value))
        return value < self.thr
