"""After sampling: append the token, detokenise, decide whether the request stops, build outputs.

Stop rules follow vLLM: `stop_token_ids` always stop; eos ids stop unless `ignore_eos`; stop
strings are searched in the new text only and truncate it (unless
`include_stop_str_in_output`); `max_tokens` and the model length end with "length".
"""

from __future__ import annotations

from rlt_serve.engine.sampler import SampleResult
from rlt_serve.engine.sequence import Sequence, SequenceStatus
from rlt_serve.outputs import CompletionOutput, RequestOutput


def find_stop_string(text: str, stops: list[str], new_chars: int) -> tuple[int, str] | None:
    """The earliest stop string that the last `new_chars` characters completed, as (index, stop).

    Only the window a new piece of text can complete is searched, so a stop string that ended
    earlier (e.g. before min_tokens allowed stopping) does not fire late. The router's streaming
    text uses the same rule."""
    longest = max(len(s) for s in stops)
    start = max(0, len(text) - new_chars - longest + 1)
    best: tuple[int, str] | None = None
    for stop in stops:
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    return best


class OutputProcessor:
    def __init__(self, eos_token_ids: set[int], max_model_len: int, tokenizer=None) -> None:
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer

    def stop_ids(self, seq: Sequence) -> set[int]:
        """Token ids that would end `seq` now; the sampler masks them until min_tokens."""
        ids = set(seq.params.stop_token_ids)
        if not seq.params.ignore_eos:
            ids |= self.eos_token_ids
        return ids

    def process_token(self, seq: Sequence, sample: SampleResult) -> SequenceStatus | None:
        """Record one sampled token; return the finish status if the request ends here."""
        seq.append_token(sample.token, sample.logprobs, sample.logprob)
        delta = ""
        if seq.detokenizer is not None:
            delta = seq.detokenizer.push(sample.token)
            seq.text += delta
        if sample.logprobs is not None and self.tokenizer is not None:
            for tok, lp in sample.logprobs.items():
                lp.decoded_token = self.tokenizer.decode([tok], skip_special_tokens=False)
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens and p.stop and delta and self._check_stop_strings(seq, len(delta)):
            return SequenceStatus.FINISHED_STOPPED  # text already cut at the stop string
        status = self._token_stop(seq, sample.token)
        if status is not None and seq.detokenizer is not None:
            seq.text += seq.detokenizer.flush()  # a held-back partial character ends the text
        return status

    def _token_stop(self, seq: Sequence, token: int) -> SequenceStatus | None:
        p, n_out = seq.params, len(seq.output_token_ids)
        if n_out >= p.min_tokens:
            if token in p.stop_token_ids:
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
            if not p.ignore_eos and token in self.eos_token_ids:
                return SequenceStatus.FINISHED_STOPPED
        limit = p.max_tokens if p.max_tokens is not None else self.max_model_len
        if n_out >= limit or seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    @staticmethod
    def _check_stop_strings(seq: Sequence, new_chars: int) -> bool:
        p = seq.params
        hit = find_stop_string(seq.text, p.stop, new_chars)
        if hit is None:
            return False
        idx, stop = hit
        seq.text = seq.text[: idx + len(stop)] if p.include_stop_str_in_output else seq.text[:idx]
        seq.stop_reason = stop
        return True

    @staticmethod
    def make_output(seq: Sequence) -> RequestOutput:
        status = seq.status
        completion = CompletionOutput(
            index=0,
            text=seq.text,
            token_ids=list(seq.output_token_ids),
            cumulative_logprob=seq.cumulative_logprob if seq.logprobs is not None else None,
            logprobs=seq.logprobs,
            finish_reason=status.value if status.finished else None,
            stop_reason=seq.stop_reason,
        )
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            prompt_logprobs=seq.prompt_logprobs,
            outputs=[completion],
            finished=status.finished,
        )
