"""`SamplingParams`, named and shaped like vLLM's, plus the per-request depth controls."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

_GREEDY_EPS = 1e-5
# Huginn's exit criteria, named as the official `generate(criterion=...)` names them.
EXIT_CRITERIA = ("kl", "minp-kl", "entropy-diff", "latent-diff", "cosine", "argmax-stability")


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    detokenize: bool = True
    # Depth control. num_loops: the depth (None: the checkpoint's); with exit_threshold q < 1 it
    # is the most loops a token may run, min_loops the fewest (Ouro's learned-gate Q-exit).
    # Huginn: exit_criterion names a training-free rule (EXIT_CRITERIA) checked every
    # exit_check_interval steps from step min_loops on; exit_threshold is its threshold (None: the
    # official "auto" value), a count of steps for argmax-stability.
    num_loops: int | None = None
    min_loops: int | None = None
    exit_threshold: float | None = None
    exit_criterion: str | None = None
    exit_check_interval: int = 1
    extra_args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        def bad(name: str, why: str) -> None:
            raise ValueError(f"{name}: {why}, got {getattr(self, name)!r}")

        if self.n != 1:
            bad("n", "only n=1 is supported by the engine; fan out requests instead")
        if self.temperature < 0:
            bad("temperature", "must be >= 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k < 0:
            bad("top_k", "must be -1, 0 (disabled) or positive")
        if not 0 <= self.min_p <= 1:
            bad("min_p", "must be in [0, 1]")
        if self.max_tokens is not None and self.max_tokens < 1:
            bad("max_tokens", "must be >= 1")
        if self.min_tokens < 0:
            bad("min_tokens", "must be >= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            bad("min_tokens", f"must be <= max_tokens ({self.max_tokens})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value < 0:
                bad(name, "must be >= 0")
        if any(not s for s in self.stop):
            bad("stop", "stop strings must be non-empty")
        if self.num_loops is not None and self.num_loops < 1:
            bad("num_loops", "must be >= 1")
        if self.min_loops is not None and self.min_loops < 1:
            bad("min_loops", "must be >= 1")
        if self.min_loops is not None and self.num_loops is not None and self.min_loops > self.num_loops:
            bad("min_loops", f"must be <= num_loops ({self.num_loops})")
        if self.exit_criterion is not None:
            if self.exit_criterion not in EXIT_CRITERIA:
                bad("exit_criterion", f"must be one of {', '.join(EXIT_CRITERIA)}")
            if self.exit_threshold is not None and not self.exit_threshold > 0.0:
                bad("exit_threshold", f"must be > 0 for exit_criterion={self.exit_criterion!r}")
            thr = self.exit_threshold
            if self.exit_criterion == "argmax-stability" and thr is not None and thr != int(thr):
                bad("exit_threshold", "must be a whole number of steps for argmax-stability")
        elif self.exit_threshold is not None and not 0.0 < self.exit_threshold <= 1.0:
            bad("exit_threshold", "must be in (0, 1]")
        if self.exit_check_interval < 1:
            bad("exit_check_interval", "must be >= 1")
        if self.exit_check_interval != 1 and self.exit_criterion is None:
            bad("exit_check_interval", "only applies with an exit_criterion")

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def clone(self, **changes: Any) -> "SamplingParams":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        values.update(changes)
        return SamplingParams(**values)
