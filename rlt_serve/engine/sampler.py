"""Token sampling: greedy, temperature, top-k, top-p, min-p, with per-request RNG.

Each request draws its noise from its own generator (exponential-race sampling: argmax of
p / Exp(1) is a draw from p), so its tokens do not depend on what else is in the batch.
Reported logprobs come from the raw model distribution, as vLLM reports them by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlt_serve.engine.sequence import Sequence
from rlt_serve.outputs import Logprob, PositionLogprobs


@dataclass
class SampleResult:
    token: int
    logprob: float
    logprobs: PositionLogprobs | None


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """For each row: the given token and the k most likely ones, with 1-based ranks."""
    out: list[PositionLogprobs] = []
    top_vals, top_idx = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    tv = top_vals.tolist() if k > 0 else [[]] * len(token_ids)
    ti = top_idx.tolist() if k > 0 else [[]] * len(token_ids)
    for i, tok in enumerate(token_ids):
        entry = {tok: Logprob(chosen_l[i], ranks_l[i])}
        for r, (t, v) in enumerate(zip(ti[i], tv[i])):
            entry.setdefault(t, Logprob(v, r + 1))
        out.append(entry)
    return out


class Sampler:
    def __init__(self, stop_ids_for: "callable[[Sequence], set[int]]") -> None:
        self._stop_ids_for = stop_ids_for

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int] | None = None
    ) -> list[SampleResult]:
        """Sample one token per row, or, given `tokens`, only report their logprobs.

        The draws stay on the device and the tokens come back with their logprobs in one host
        read, so a decode step waits on the device once however many rows it samples."""
        raw = torch.log_softmax(logits, dim=-1)
        if tokens is None:
            picked = self._draw(logits, seqs)
        else:
            picked = torch.tensor(tokens, device=raw.device)
        chosen_t = raw.gather(1, picked[:, None]).squeeze(1)
        # One read: token ids are exact in float64.
        tokens_f, chosen = torch.stack([picked.to(torch.float64), chosen_t.to(torch.float64)]).tolist()
        tokens = [int(t) for t in tokens_f]
        k = max((s.params.logprobs or 0) for s in seqs)
        need = any(s.params.logprobs is not None for s in seqs)
        tables = top_logprobs(raw, tokens, k) if need else [None] * len(seqs)
        results = []
        for i, seq in enumerate(seqs):
            table = None
            if seq.params.logprobs is not None:
                keep = seq.params.logprobs
                table = {t: lp for t, lp in tables[i].items() if t == tokens[i] or lp.rank <= keep}
            results.append(SampleResult(tokens[i], chosen[i], table))
        return results

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """[n] token ids on the device: argmax for plain greedy rows in one launch, and for the
        others the same per-request exponential race as `race`, so the RNG stream is unchanged."""
        greedy_plain = [s.params.greedy and len(s.output_token_ids) >= s.params.min_tokens for s in seqs]
        out = logits.argmax(dim=-1)
        if all(greedy_plain):
            return out
        for i, seq in enumerate(seqs):
            if greedy_plain[i]:
                continue
            probs = self.probs(logits[i], seq)
            if seq.params.greedy:
                out[i] = probs.argmax()
            else:
                noise = torch.empty_like(probs).exponential_(generator=seq.generator)
                out[i] = (probs / noise).argmax()
        return out

    def probs(self, row: torch.Tensor, seq: Sequence, extra_outputs: int = 0) -> torch.Tensor:
        """The distribution a token is drawn from: min_tokens masks, then temperature, top-k,
        top-p, min-p; one-hot for greedy. `extra_outputs` counts unverified drafts before it."""
        p = seq.params
        if len(seq.output_token_ids) + extra_outputs < p.min_tokens:
            ids = [t for t in self._stop_ids_for(seq) if t < row.shape[-1]]
            if ids:
                row = row.clone()
                row[ids] = float("-inf")
        if p.greedy:
            return torch.nn.functional.one_hot(row.argmax(), row.shape[-1]).to(torch.float32)
        row = row / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[-1]:
            kth = row.topk(p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        if p.top_p < 1.0:
            sorted_p, order = probs.sort(descending=True)
            cum = sorted_p.cumsum(-1)
            drop = (cum - sorted_p) > p.top_p  # keep the smallest prefix whose mass reaches top_p
            probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        return probs

    @staticmethod
    def race(probs: torch.Tensor, seq: Sequence) -> int:
        """A draw from `probs` (unnormalised is fine) with the request's own generator."""
        if seq.params.greedy:
            return int(probs.argmax())
        noise = torch.empty_like(probs).exponential_(generator=seq.generator)
        return int((probs / noise).argmax())

    @staticmethod
    def accept(p_y: float, q_y: float, seq: Sequence) -> bool:
        """Speculative rejection test: keep draft y with probability min(1, p(y) / q(y))."""
        if q_y <= 0.0:
            return False
        if p_y >= q_y:
            return True
        u = torch.rand((), generator=seq.generator, device=seq.generator.device)
        return bool(u < p_y / q_y)
