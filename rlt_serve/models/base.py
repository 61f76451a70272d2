"""The stage interface every looped model family implements.

prelude (once per token) -> core (once per depth, rows at mixed depths) -> coda (once per exit)
-> logits (only where a distribution is needed). Stages that contain attention receive a
`CoreContext` whose rows all use depth slot 0 for prelude and coda planes; core rows use their
own depth. Families without prelude/coda attention ignore the context.
"""

from __future__ import annotations

from abc import abstractmethod
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from rlt_serve.config import ModelConfig
from rlt_serve.models.layers import CoreContext


@dataclass
class PreludeOutput:
    hidden: torch.Tensor  # [T, H] state entering depth 0
    injected: torch.Tensor | None = None  # [T, H] re-injected into every core step (Huginn)


@dataclass
class CoreOutput:
    hidden: torch.Tensor  # [T, H] state after this depth (the next depth's input)
    gate_logits: torch.Tensor | None = None  # [T] fp32 raw exit-gate output (Ouro)


class LoopedModel(nn.Module):
    # Token strings a chat reply ends with even where config/tokenizer name another eos.
    extra_stop_tokens: tuple[str, ...] = ()
    # Whether prelude / coda contain attention layers (and so need KV metadata and planes).
    prelude_attention: bool = False
    coda_attention: bool = False
    # Whether every core step also reads the prelude's output (`PreludeOutput.injected`).
    injects_prelude: bool = False

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg

    @abstractmethod
    def kv_slots_per_layer(self, max_loops: int) -> list[int]:
        """Depth slots of each attention layer, in KV layer-index order."""

    @abstractmethod
    def prelude(self, token_ids: torch.Tensor, positions: torch.Tensor, ctx: CoreContext | None) -> PreludeOutput: ...

    @abstractmethod
    def core(
        self, hidden: torch.Tensor, injected: torch.Tensor | None, positions: torch.Tensor, ctx: CoreContext
    ) -> CoreOutput: ...

    def initial_state(self, pre: PreludeOutput, seeds: list[int], positions: torch.Tensor) -> torch.Tensor:
        """State entering depth 0 per token, given each token's request seed and position. The
        prelude's output here; Huginn draws a random state keyed by (seed, position), so it does not
        depend on batching, preemption or recomputation."""
        return pre.hidden

    def fuse_weights(self) -> None:
        """After loading: merge projections that read the same input into one matmul weight."""

    def prepare_sequence(self, seq: Any) -> None:
        """Per-request setup a family needs before scheduling (Huginn: cache salt, exit records)."""

    def coda(self, hidden: torch.Tensor, positions: torch.Tensor, ctx: CoreContext | None) -> torch.Tensor:
        """Per-exit layers before the head; the identity for Ouro and Nanbeige."""
        return hidden

    @abstractmethod
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits for the given (already coda-processed) hidden states."""
