"""One choice's text: detokenise streamed ids, apply stop strings, hold back what may be a stop.

Workers send token ids only, so stop strings are the router's job. The rule is the engine's
(`rlt_serve.engine.output_processor`): once `min_tokens` are out, each new piece of text is
searched, together with the `longest stop - 1` characters before it, for the earliest stop
string; the text is cut there (kept with `include_stop_str_in_output`). While streaming, text
that could still turn out to be the start of a stop string is held back, so the client never
receives characters that the cut would later take away.
"""

from __future__ import annotations

from rlt_serve.engine.output_processor import find_stop_string
from rlt_serve.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        include_stop: bool = False,
        min_tokens: int = 0,
        skip_special_tokens: bool = True,
    ) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=skip_special_tokens)
        self.stop = stop
        self.include_stop = include_stop
        self.min_tokens = min_tokens
        self._longest = max((len(s) for s in stop), default=0)
        self.text = ""
        self.num_tokens = 0
        self.stop_reason: str | None = None  # the stop string that ended the text
        self.finished = False
        self._sent = 0

    def push(self, token_id: int) -> bool:
        """Add a token; True when a stop string ends the text here (later tokens are dropped)."""
        if self.finished:
            return True
        self.num_tokens += 1
        delta = self._detok.push(token_id)
        self.text += delta
        if self.stop and delta and self.num_tokens >= self.min_tokens and self._cut(len(delta)):
            self.finished = True
        return self.finished

    def finish(self) -> None:
        """The worker ended the request: whatever the detokenizer still holds is text too."""
        if not self.finished:
            self.text += self._detok.flush()
            self.finished = True

    def _cut(self, new_chars: int) -> bool:
        best = find_stop_string(self.text, self.stop, new_chars)
        if best is None:
            return False
        i, s = best
        self.text = self.text[: i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def _held(self) -> int:
        """Characters at the end of the text that a later cut could still remove."""
        if self.finished or not self.stop:
            return 0
        if self.num_tokens < self.min_tokens:
            return min(len(self.text), self._longest - 1)  # the first check looks back this far
        tail = self.text[-(self._longest - 1) :] if self._longest > 1 else ""
        for j in range(len(tail), 0, -1):
            if any(len(s) > j and s.startswith(tail[-j:]) for s in self.stop):
                return j
        return 0

    def take(self) -> str:
        """The text that may be sent now and was not sent yet."""
        end = max(self._sent, len(self.text) - self._held())
        out = self.text[self._sent : end]
        self._sent = end
        return out
