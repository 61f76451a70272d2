"""Tensors in, logits out: runs one step (prelude for new spans, one core call, coda for exits).

A step takes the scheduler's rows, embeds the spans that start at depth 0, runs the core once
over all rows at their own depths (each row's KV plane follows its depth), and applies the coda
only where a row leaves the core and a distribution is needed: the last position of a sequence
(to sample) and, when asked for, prompt positions (prompt_logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rlt_serve.attention import RowSpec, get_attention_backend
from rlt_serve.config import EngineConfig, ModelConfig
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.engine.scheduler import SchedulerOutput
from rlt_serve.engine.sequence import Sequence
from rlt_serve.loader import load_into_module
from rlt_serve.models import get_model_class
from rlt_serve.models.layers import CoreContext

_ACTIVATION_RESERVE = 1 << 30  # bytes of device memory left for activations when sizing the pool


@dataclass
class RunnerOutput:
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_logits: torch.Tensor | None = None  # [len(sample_seqs), V] fp32
    # (sequence, first position, logits [n, V]) whose rows predict prompt tokens position+1...
    prompt_logits: list[tuple[Sequence, int, torch.Tensor]] = field(default_factory=list)


class ModelRunner:
    def __init__(
        self,
        model_dir: str,
        model_config: ModelConfig,
        engine_config: EngineConfig,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.model_config = model_config
        self.engine_config = engine_config
        self.dtype = dtype
        self.device = device
        with torch.device("meta"):
            model = get_model_class(model_config)(model_config)
        load_into_module(model, model_dir, dtype, device)
        self.model = model.eval()
        self.max_loops = engine_config.max_loops or model_config.num_loops
        self.slots_per_layer = model.kv_slots_per_layer(self.max_loops)
        self.kv = KVCache(
            slots_per_layer=self.slots_per_layer,
            num_pages=self._num_pages(),
            page_size=engine_config.page_size,
            kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.backend = get_attention_backend(engine_config.attention_backend, device)

    def _num_pages(self) -> int:
        ec, mc = self.engine_config, self.model_config
        if ec.num_kv_pages is not None:
            return ec.num_kv_pages
        per_token = KVCache.bytes_per_token(sum(self.slots_per_layer), mc.num_key_value_heads, mc.head_dim, self.dtype)
        budget = ec.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * ec.gpu_memory_utilization) - (total - free) - _ACTIVATION_RESERVE
        return max(1, budget // (per_token * ec.page_size))

    def _context(self, seqs: list[Sequence], depth_of) -> CoreContext:
        specs = [RowSpec(s.span.num_tokens, s.span.start, depth_of(s), s.page_table) for s in seqs]
        return CoreContext(self.backend, self.kv, self.backend.prepare(specs, self.kv))

    @staticmethod
    def _positions(seqs: list[Sequence], device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(s.span.start, s.span.end) for s in seqs]).to(device)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        rows, model, dev = sched.rows, self.model, self.device
        starting = [seq for seq in rows if seq.span.depth == 0]
        if starting:
            ids = [t for seq in starting for t in seq.token_ids(seq.span.start, seq.span.end)]
            ctx = self._context(starting, lambda s: 0) if model.prelude_attention else None
            pre = model.prelude(torch.tensor(ids, dtype=torch.long, device=dev), self._positions(starting, dev), ctx)
            sizes = [s.span.num_tokens for s in starting]
            injected = pre.injected.split(sizes) if pre.injected is not None else [None] * len(starting)
            for seq, h, e in zip(starting, pre.hidden.split(sizes), injected):
                seq.span.hidden, seq.span.injected = h, e
        hidden = torch.cat([seq.span.hidden for seq in rows])
        injected = torch.cat([seq.span.injected for seq in rows]) if rows[0].span.injected is not None else None
        ctx = self._context(rows, lambda s: s.span.depth)
        core = model.core(hidden, injected, self._positions(rows, dev), ctx)
        for seq, h in zip(rows, core.hidden.split([s.span.num_tokens for s in rows])):
            seq.span.hidden = h
        return self._coda([seq for seq in rows if seq.span.depth + 1 == seq.num_loops])

    def _coda(self, exiting: list[Sequence]) -> RunnerOutput:
        """Run the coda where rows leave the core; logits only where a distribution is needed."""
        out = RunnerOutput()
        if not exiting:
            return out
        model = self.model
        if model.coda_attention:  # every exiting token writes its coda KV, later tokens read it
            ctx = self._context(exiting, lambda s: 0)
            coded = model.coda(torch.cat([s.span.hidden for s in exiting]), self._positions(exiting, self.device), ctx)
            for seq, h in zip(exiting, coded.split([s.span.num_tokens for s in exiting])):
                seq.span.hidden = h
        picks: list[torch.Tensor] = []
        prompt_parts: list[tuple[Sequence, int, int]] = []
        for seq in exiting:
            span = seq.span
            if seq.wants_prompt_logprobs():
                # Positions already recorded (before a preemption) are not recorded twice.
                first = max(span.start, len(seq.prompt_logprobs) - 1)
                stop = min(span.end, seq.num_prompt_tokens - 1)
                if stop > first:
                    prompt_parts.append((seq, first, stop - first))
                    picks.append(span.hidden[first - span.start : stop - span.start])
        for seq in exiting:
            if seq.span.end == seq.num_tokens:
                out.sample_seqs.append(seq)
                picks.append(seq.span.hidden[-1:])
        if not picks:
            return out
        selected = torch.cat(picks)
        if not model.coda_attention:
            selected = model.coda(selected, None, None)
        logits = model.compute_logits(selected)
        offset = 0
        for seq, start, n in prompt_parts:
            out.prompt_logits.append((seq, start, logits[offset : offset + n]))
            offset += n
        if out.sample_seqs:
            out.sample_logits = logits[offset:]
        return out
