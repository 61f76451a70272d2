"""The dense reference implementation: the oracle every optimised path is compared against.

Written from MODELS.md §1.3 (Ouro) and §2.3 (Nanbeige4.2) and the golden README, and kept
independent of `rlt_serve.models` and the engine so that a bug there cannot hide in both.
Batch 1, no KV cache, no paging: every call recomputes the whole sequence through every loop.
It is vectorised over the sequence, so hundreds of tokens on a tiny model take milliseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from rlt_serve.config import ConfigError, ModelConfig
from rlt_serve.loader import load_state_dict


@dataclass
class ReferenceOutput:
    logits: torch.Tensor  # [S, V] fp32, lm_head of the last loop (fixed-depth semantics)
    loop_hidden: torch.Tensor  # [T, S, H] model dtype, model.norm output after each loop
    gate_logits: torch.Tensor | None  # [S, T] fp32 raw exit-gate output (Ouro only)
    exit_pdf: torch.Tensor | None  # [S, T] fp32 exit probability per loop (Ouro only)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalise in fp32, cast back, then scale: the order both families' RMSNorm uses."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * y.to(x.dtype)


def rope_cos_sin(
    num_positions: int, head_dim: int, theta: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half tables [S, head_dim]: inv_freq over head_dim, angles in fp32, then cast."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = torch.arange(num_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def stored_kv(x: torch.Tensor, kv_dtype: torch.dtype | None) -> torch.Tensor:
    """K or V as a cache of `kv_dtype` gives it back (rounded to that dtype, read as x's); None: x."""
    return x if kv_dtype is None or kv_dtype == x.dtype else x.to(kv_dtype).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


class ReferenceModel:
    """Ouro or Nanbeige4.2 as plain tensor math over a weight dict. `kv_dtype`: attention reads
    K/V rounded to that storage dtype (the engine's `kv_cache_dtype`), every key its own included."""

    def __init__(
        self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype: torch.dtype,
        kv_dtype: torch.dtype | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.weights = weights
        self.dtype = dtype
        self.kv_dtype = kv_dtype

    @classmethod
    def from_pretrained(
        cls, model_dir: str, dtype: torch.dtype = torch.float32, hf_overrides: dict[str, Any] | None = None
    ) -> "ReferenceModel":
        config = ModelConfig.from_pretrained(model_dir, hf_overrides)
        keys = cls.weight_keys(config)
        if config.tie_word_embeddings:
            keys.remove("lm_head.weight")
        weights = load_state_dict(model_dir, keys=keys, dtype=dtype)
        if config.tie_word_embeddings:
            # Tied: the output projection *is* the embedding (what HF's tie_weights does).
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        return cls(config, weights, dtype)

    @staticmethod
    def weight_keys(config: ModelConfig) -> list[str]:
        """The checkpoint keys the forward reads (MODELS.md §1.7, §2.7)."""
        norms = ["input_layernorm", "post_attention_layernorm"]
        if config.sandwich_norm:
            norms += ["input_layernorm_2", "post_attention_layernorm_2"]
        keys = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        for i in range(config.num_hidden_layers):
            p = f"model.layers.{i}."
            keys += [p + f"self_attn.{n}_proj.weight" for n in ("q", "k", "v", "o")]
            keys += [p + f"mlp.{n}_proj.weight" for n in ("gate", "up", "down")]
            keys += [p + f"{n}.weight" for n in norms]
        if config.exit_gate:
            keys += ["model.early_exit_gate.weight", "model.early_exit_gate.bias"]
        return keys

    def _num_loops(self, num_loops: int | None) -> int:
        cfg = self.config
        if num_loops is None:
            return cfg.num_loops
        if num_loops < 1:
            raise ConfigError(f"num_loops must be >= 1, got {num_loops}")
        if not cfg.variable_depth and num_loops != cfg.num_loops:
            raise ConfigError(f"{cfg.model_type} runs exactly {cfg.num_loops} loops, got num_loops={num_loops}")
        return num_loops

    def _attention(self, p: str, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Causal GQA self-attention over x [S, H]; softmax in fp32 like the eager reference."""
        cfg, w = self.config, self.weights
        s, d = x.shape[0], cfg.head_dim
        q = F.linear(x, w[p + "q_proj.weight"]).view(s, cfg.num_attention_heads, d).transpose(0, 1)
        k = F.linear(x, w[p + "k_proj.weight"]).view(s, cfg.num_key_value_heads, d).transpose(0, 1)
        v = F.linear(x, w[p + "v_proj.weight"]).view(s, cfg.num_key_value_heads, d).transpose(0, 1)
        q = q * cos + rotate_half(q) * sin
        k = stored_kv(k * cos + rotate_half(k) * sin, self.kv_dtype)
        v = stored_kv(v, self.kv_dtype)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        k = k.repeat_interleave(group, dim=0)  # query head h reads kv head h // group
        v = v.repeat_interleave(group, dim=0)
        scores = (q @ k.transpose(1, 2)) * d**-0.5
        causal = torch.ones(s, s, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        o = (probs @ v).transpose(0, 1).reshape(s, cfg.num_attention_heads * d)
        return F.linear(o, w[p + "o_proj.weight"])

    def _mlp(self, p: str, x: torch.Tensor) -> torch.Tensor:
        w = self.weights
        gate = F.linear(x, w[p + "gate_proj.weight"])
        up = F.linear(x, w[p + "up_proj.weight"])
        return F.linear(F.silu(gate) * up, w[p + "down_proj.weight"])

    def _layer(self, i: int, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        cfg, w, eps = self.config, self.weights, self.config.rms_norm_eps
        p = f"model.layers.{i}."
        a = self._attention(p + "self_attn.", rms_norm(h, w[p + "input_layernorm.weight"], eps), cos, sin)
        if cfg.sandwich_norm:  # Ouro: norm each sublayer's output before the residual add
            a = rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
        h = h + a
        m = self._mlp(p + "mlp.", rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
        if cfg.sandwich_norm:
            m = rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
        return h + m

    @torch.no_grad()
    def forward(self, ids: list[int], num_loops: int | None = None) -> ReferenceOutput:
        """All positions of one sequence through `num_loops` loops (default: the checkpoint's)."""
        if len(ids) == 0:
            raise ValueError("forward needs at least one token")
        cfg, w = self.config, self.weights
        loops = self._num_loops(num_loops)
        h = w["model.embed_tokens.weight"][torch.as_tensor(ids, dtype=torch.long)]
        cos, sin = rope_cos_sin(len(ids), cfg.head_dim, cfg.rope_theta, self.dtype)
        hidden = []
        for _ in range(loops):
            for i in range(cfg.num_hidden_layers):
                h = self._layer(i, h, cos, sin)
            # model.norm after every loop; its output is both the loop's state and the next input.
            h = rms_norm(h, w["model.norm.weight"], cfg.rms_norm_eps)
            hidden.append(h)
        loop_hidden = torch.stack(hidden)
        logits = F.linear(h, w["lm_head.weight"]).float()
        gate_logits = exit_pdf = None
        if cfg.exit_gate:
            g = F.linear(loop_hidden, w["model.early_exit_gate.weight"], w["model.early_exit_gate.bias"])
            gate_logits = g.squeeze(-1).transpose(0, 1).float()  # [S, T]
            exit_pdf = self.exit_pdf(gate_logits)
        return ReferenceOutput(logits, loop_hidden, gate_logits, exit_pdf)

    @staticmethod
    def exit_pdf(gate_logits: torch.Tensor) -> torch.Tensor:
        """p_u = λ_u ∏_{v<u}(1-λ_v), the last loop taking the remaining mass; fp32."""
        lam = torch.sigmoid(gate_logits.float())
        remaining = torch.ones_like(lam[..., 0])
        probs = []
        for u in range(lam.shape[-1] - 1):
            probs.append(lam[..., u] * remaining)
            remaining = remaining * (1.0 - lam[..., u])
        probs.append(remaining)
        return torch.stack(probs, dim=-1)

    def loop_logits(self, out: ReferenceOutput) -> torch.Tensor:
        """[T, S, V] fp32 lm_head of every loop's hidden state (what an exit at loop u emits)."""
        return F.linear(out.loop_hidden, self.weights["lm_head.weight"]).float()

    @torch.no_grad()
    def forward_shared_kv(self, ids: list[int], num_loops: int | None = None) -> torch.Tensor:
        """Logits [S, V] under the opt-in `shared` KV layout: each core layer keeps one K/V slot,
        overwritten every loop, so a token reads earlier tokens at their final loop and itself at
        its current loop. Not the model's trained semantics."""
        return self._token_by_token(ids, self._num_loops(num_loops), shared=True)[0]

    @torch.no_grad()
    def forward_q_exit(
        self, ids: list[int], threshold: float, min_loops: int = 1, num_loops: int | None = None,
        delay: bool = False,
    ) -> tuple[torch.Tensor, list[int]]:
        """Ouro's Q-exit with compute skipped: (logits [S, V], exit loop per token).

        Token t leaves at the first loop u with u + 1 >= min_loops and 1 - prod_{v<=u}(1 - sigmoid(g_v))
        >= threshold (fp32), else at the last loop; its logits come from that loop's state. Later
        tokens read its K/V at loop min(u', exit) (the `last_exited` semantics). `delay`: delayed
        exit, the token runs one more loop after the rule fires (at most the last) and leaves there."""
        if not self.config.exit_gate:
            raise ConfigError(f"{self.config.model_type} has no exit gate")
        return self._token_by_token(ids, self._num_loops(num_loops), shared=False, q=(threshold, min_loops, delay))

    def _token_by_token(
        self, ids: list[int], loops: int, shared: bool, q: tuple[float, int, bool] | None = None
    ) -> tuple[torch.Tensor, list[int]]:
        """One token at a time through its loops, against per-(layer, slot) lists of earlier K/V."""
        cfg, w, eps = self.config, self.weights, self.config.rms_norm_eps
        d = cfg.head_dim
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        cos_all, sin_all = rope_cos_sin(len(ids), d, cfg.rope_theta, self.dtype)
        n_slots = 1 if shared else loops
        cache = [[([], []) for _ in range(n_slots)] for _ in range(cfg.num_hidden_layers)]
        rows, exits = [], []
        for t, tok in enumerate(ids):
            h = w["model.embed_tokens.weight"][tok : tok + 1]
            cos, sin = cos_all[..., t : t + 1, :], sin_all[..., t : t + 1, :]
            own: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(cfg.num_hidden_layers)]
            remaining, exit_at, fired = torch.ones((), dtype=torch.float32), loops - 1, False
            for u in range(loops):
                for i in range(cfg.num_hidden_layers):
                    p = f"model.layers.{i}."
                    x = rms_norm(h, w[p + "input_layernorm.weight"], eps)
                    q_ = F.linear(x, w[p + "self_attn.q_proj.weight"]).view(1, cfg.num_attention_heads, d).transpose(0, 1)
                    k = F.linear(x, w[p + "self_attn.k_proj.weight"]).view(1, cfg.num_key_value_heads, d).transpose(0, 1)
                    v = F.linear(x, w[p + "self_attn.v_proj.weight"]).view(1, cfg.num_key_value_heads, d).transpose(0, 1)
                    q_ = q_ * cos + rotate_half(q_) * sin
                    k = stored_kv(k * cos + rotate_half(k) * sin, self.kv_dtype)
                    v = stored_kv(v, self.kv_dtype)
                    own[i].append((k, v))
                    ks, vs = cache[i][0 if shared else u]
                    keys = torch.cat(ks + [k], dim=1).repeat_interleave(group, dim=0)
                    vals = torch.cat(vs + [v], dim=1).repeat_interleave(group, dim=0)
                    probs = torch.softmax((q_ @ keys.transpose(1, 2)) * d**-0.5, dim=-1, dtype=torch.float32)
                    o = (probs.to(x.dtype) @ vals).transpose(0, 1).reshape(1, -1)
                    a = F.linear(o, w[p + "self_attn.o_proj.weight"])
                    if cfg.sandwich_norm:
                        a = rms_norm(a, w[p + "input_layernorm_2.weight"], eps)
                    h = h + a
                    m = self._mlp(p + "mlp.", rms_norm(h, w[p + "post_attention_layernorm.weight"], eps))
                    if cfg.sandwich_norm:
                        m = rms_norm(m, w[p + "post_attention_layernorm_2.weight"], eps)
                    h = h + m
                h = rms_norm(h, w["model.norm.weight"], eps)
                if fired:  # delayed exit: this was the loop after the decision
                    exit_at = u
                    break
                if q is not None and u + 1 < loops:
                    g = F.linear(h, w["model.early_exit_gate.weight"], w["model.early_exit_gate.bias"])
                    remaining = remaining * (1.0 - torch.sigmoid(g.float()).reshape(()))
                    if u + 1 >= q[1] and float(1.0 - remaining) >= q[0]:
                        if q[2]:
                            fired = True
                            continue
                        exit_at = u
                        break
            for i in range(cfg.num_hidden_layers):  # publish this token's K/V for later tokens
                for slot in range(n_slots):
                    k, v = own[i][-1] if shared else own[i][min(slot, exit_at)]
                    cache[i][slot][0].append(k)
                    cache[i][slot][1].append(v)
            rows.append(F.linear(h, w["lm_head.weight"]).float()[0])
            exits.append(exit_at)
        return torch.stack(rows), exits

    def greedy(
        self, ids: list[int], max_tokens: int, num_loops: int | None = None
    ) -> tuple[list[int], torch.Tensor]:
        """Argmax decode by full recomputation; row k of the logits [G, V] produced token k."""
        seq = list(ids)
        tokens: list[int] = []
        rows = []
        for _ in range(max_tokens):
            row = self.forward(seq, num_loops).logits[-1]
            tok = int(torch.argmax(row))
            rows.append(row)
            tokens.append(tok)
            seq.append(tok)
        logits = torch.stack(rows) if rows else torch.empty(0, self.config.vocab_size)
        return tokens, logits
