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


def _table(token: int, chosen: float, rank: int, top_ids: list, top_vals: list) -> PositionLogprobs:
    """One position's entry: the given token with its 1-based rank, then the top ones."""
    entry = {token: Logprob(chosen, rank)}
    for r, (t, v) in enumerate(zip(top_ids, top_vals)):
        entry.setdefault(int(t), Logprob(v, r + 1))
    return entry


def top_logprobs(logprobs: torch.Tensor, token_ids: list[int], k: int) -> list[PositionLogprobs]:
    """For each row: the given token and the k most likely ones, with 1-based ranks."""
    top_vals, top_idx = logprobs.topk(k, dim=-1) if k > 0 else (None, None)
    chosen = logprobs.gather(1, torch.tensor(token_ids, device=logprobs.device)[:, None]).squeeze(1)
    ranks = (logprobs > chosen[:, None]).sum(-1) + 1
    chosen_l, ranks_l = chosen.tolist(), ranks.tolist()
    tv = top_vals.tolist() if k > 0 else [[]] * len(token_ids)
    ti = top_idx.tolist() if k > 0 else [[]] * len(token_ids)
    return [_table(tok, chosen_l[i], ranks_l[i], ti[i], tv[i]) for i, tok in enumerate(token_ids)]


class Sampler:
    def __init__(self, stop_ids_for: "callable[[Sequence], set[int]]") -> None:
        self._stop_ids_for = stop_ids_for

    def __call__(
        self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int] | None = None
    ) -> list[SampleResult]:
        """Sample one token per row, or, given `tokens`, only report their logprobs.

        The draws stay on the device and the tokens come back with their logprobs in one host
        read, so a decode step waits on the device once however many rows it samples."""
        _, packed = self.sample_packed(logits, seqs, tokens)
        return self.unpack(packed.tolist(), seqs)

    def sample_packed(
        self, logits: torch.Tensor, seqs: list[Sequence], tokens: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The draws without reading them: (token ids [n] int64, packed [n, C] float64) on the
        device. A packed row is (token, logprob[, rank, top-k ids, top-k logprobs]); ids and ranks
        are exact in float64, so one copy brings everything back (async scheduling reads it a step
        later)."""
        raw = torch.log_softmax(logits, dim=-1)
        picked = self._draw(logits, seqs) if tokens is None else torch.tensor(tokens, device=raw.device)
        chosen = raw.gather(1, picked[:, None])
        cols = [picked[:, None].to(torch.float64), chosen.to(torch.float64)]
        if any(s.params.logprobs is not None for s in seqs):
            cols.append(((raw > chosen).sum(-1, keepdim=True) + 1).to(torch.float64))
            k = max((s.params.logprobs or 0) for s in seqs)
            if k > 0:
                vals, idx = raw.topk(k, dim=-1)
                cols += [idx.to(torch.float64), vals.to(torch.float64)]
        return picked, torch.cat(cols, dim=1)

    @staticmethod
    def unpack(rows: list[list[float]], seqs: list[Sequence]) -> list[SampleResult]:
        """`SampleResult`s from `sample_packed`'s rows read back to the host."""
        results = []
        for row, seq in zip(rows, seqs):
            token, table = int(row[0]), None
            keep = seq.params.logprobs
            if keep is not None:
                k = (len(row) - 3) // 2
                full = _table(token, row[1], int(row[2]), row[3 : 3 + k], row[3 + k :])
                table = {t: lp for t, lp in full.items() if t == token or lp.rank <= keep}
            results.append(SampleResult(token, row[1], table))
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
