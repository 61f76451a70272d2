"""Tensors in, logits out: runs one step (prelude for new spans, one core call, coda for exits).

A step takes the scheduler's rows, embeds the spans that start at depth 0, runs the core once
over all rows at their own depths (each row's KV plane follows its depth), and applies the coda
only where a row leaves the core and a distribution is needed: the last position of a sequence
(to sample) and, when asked for, prompt positions (prompt_logprobs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch

from rlt_serve.attention import RowSpec, get_attention_backend
from rlt_serve.config import ConfigError, EngineConfig, ModelConfig, core_ring_slots
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.engine.exit_criteria import exit_step, needs_distribution, new_exit_state, record_exit_depths
from rlt_serve.engine.scheduler import Row, SchedulerOutput
from rlt_serve.engine.sequence import Sequence, Span
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
    exit_depths: list[int] = field(default_factory=list)  # depth at which each token left the core
    draft_logits: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)  # shallow [1, V]
    verify_logits: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)  # full depth [K, V]
    # Prefill-only requests (PD): the post-coda state [1, H] of the last prompt position, which
    # the decode side feeds to `compute_logits` instead of sampling here.
    final_states: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)


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
        # `shared` and Huginn's compress-s{k} keep a ring of slots per core layer, not one per depth.
        self.ring = core_ring_slots(model_config, engine_config)
        self.fills_deeper_slots = engine_config.kv_layout == "last_exited" or engine_config.huginn_cache == "latest-m4"
        self.slots_per_layer = model.kv_slots_per_layer(self.ring or self.max_loops)
        self.kv = KVCache(
            slots_per_layer=self.slots_per_layer,
            num_pages=self._num_pages(),
            page_size=engine_config.page_size,
            kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.backend = get_attention_backend(engine_config.attention_backend, device, dtype, engine_config.page_size)

    def _num_pages(self) -> int:
        ec, mc = self.engine_config, self.model_config
        if ec.num_kv_pages is not None:
            return ec.num_kv_pages
        per_token = KVCache.bytes_per_token(sum(self.slots_per_layer), mc.num_key_value_heads, mc.head_dim, self.dtype)
        budget = ec.kv_cache_memory_bytes
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * ec.gpu_memory_utilization) - (total - free) - _ACTIVATION_RESERVE
        pages = budget // (per_token * ec.page_size)
        if pages < 1:
            raise ConfigError(
                f"no device memory left for the KV cache: gpu_memory_utilization={ec.gpu_memory_utilization} of "
                f"{total >> 20} MiB with {free >> 20} MiB free (another engine in this process?); lower it or set num_kv_pages"
            )
        return pages

    def depth_slot(self, depth: int) -> int:
        """The KV slot a core row at `depth` reads and writes under the engine's layout."""
        return depth % self.ring if self.ring else depth

    def _context(self, rows: list[Row], core: bool) -> CoreContext:
        specs = [
            RowSpec(span.num_tokens, span.start, self.depth_slot(span.depth) if core else 0, seq.page_table)
            for seq, span in rows
        ]
        write_mask = None
        if core and any(span.exit is not None for _, span in rows):
            write_mask = torch.cat(
                [
                    ~span.exit.exited.to(self.device) if span.exit is not None
                    else torch.ones(span.num_tokens, dtype=torch.bool, device=self.device)
                    for _, span in rows
                ]
            )
        return CoreContext(self.backend, self.kv, self.backend.prepare(specs, self.kv, write_mask))

    @staticmethod
    def _positions(rows: list[Row], device: torch.device) -> torch.Tensor:
        return torch.cat([torch.arange(span.start, span.end) for _, span in rows]).to(device)

    @staticmethod
    def _split(rows: list[Row], t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.split([span.num_tokens for _, span in rows])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        rows, model, dev = sched.rows, self.model, self.device
        starting = [(seq, span) for seq, span in rows if span.depth == 0]
        if starting:
            ids = [t for seq, span in starting for t in seq.token_ids(span.start, span.end)]
            ctx = self._context(starting, core=False) if model.prelude_attention else None
            positions = self._positions(starting, dev)
            pre = model.prelude(torch.tensor(ids, dtype=torch.long, device=dev), positions, ctx)
            seeds = [s for seq, span in starting for s in [seq.generator.initial_seed()] * span.num_tokens]
            state = model.initial_state(pre, seeds, positions)
            injected = self._split(starting, pre.injected) if pre.injected is not None else [None] * len(starting)
            for (seq, span), h, e in zip(starting, self._split(starting, state), injected):
                span.hidden, span.injected = h, e
                if seq.adaptive:
                    span.exit = new_exit_state(seq, span, h)
        hidden = torch.cat([span.hidden for _, span in rows])
        injected = torch.cat([span.injected for _, span in rows]) if rows[0][1].injected is not None else None
        core = model.core(hidden, injected, self._positions(rows, dev), self._context(rows, core=True))
        gates = self._split(rows, core.gate_logits) if core.gate_logits is not None else [None] * len(rows)
        fills: list[tuple[Sequence, Span, torch.Tensor]] = []  # tokens that left the core now
        adaptive: list[Span] = []
        dists = self._check_logits(rows, core.hidden)
        for (seq, span), h, g in zip(rows, self._split(rows, core.hidden), gates):
            span.hidden = h
            if span.exit is not None:
                new = exit_step(seq, span, h, g, dists.get(id(span)))
                fills.append((seq, span, new))
                adaptive.append(span)
            elif span.depth + 1 == (span.stop_depth or seq.num_loops):
                span.finished = True
                if span.kind == "draft":  # its deeper loops come with the verify row
                    continue
                fills.append((seq, span, torch.ones(span.num_tokens, dtype=torch.bool, device=dev)))
        if adaptive:
            self._decide_exits(rows, adaptive)
        if self.fills_deeper_slots:
            self._fill_deeper_slots(fills)
        return self._coda([(seq, span) for seq, span in rows if span.finished])

    def _check_logits(self, rows: list[Row], hidden: torch.Tensor) -> dict[int, torch.Tensor]:
        """Next-token logits [V] of each row whose exit criterion reads the distribution at this
        depth (Huginn's KL, entropy and argmax rules), keyed by id(span): the coda over the row's
        tokens at their current state (it writes their coda K/V, rewritten when they exit), then
        the head at the row's last token, as the official evaluators call `predict_from_latents`."""
        idx = [i for i, (seq, span) in enumerate(rows) if needs_distribution(seq, span)]
        if not idx:
            return {}
        parts = self._split(rows, hidden)
        picked = [rows[i] for i in idx]
        coded = self.model.coda(
            torch.cat([parts[i] for i in idx]), self._positions(picked, self.device), self._context(picked, core=False)
        )
        last = torch.tensor(list(itertools.accumulate(span.num_tokens for _, span in picked)), device=self.device) - 1
        logits = self.model.compute_logits(coded[last])
        return {id(span): row for (_, span), row in zip(picked, logits)}

    def _decide_exits(self, rows: list[Row], adaptive: list[Span]) -> None:
        """Whether each adaptive row has left the core entirely.

        Synchronous: one host read per call, of this call's gate decisions. Delayed: the read is of
        the previous call's decisions, which finished long ago, so the host never waits on this
        call's gate; a row whose tokens all exited at depth t therefore computes one extra loop,
        whose K/V writes are masked and whose state is never read (the logits come from the
        stored exit-depth state), so tokens and exit depths equal the synchronous policy's."""
        seq_of = {id(span): seq for seq, span in rows}
        if not self.engine_config.delayed_exit:
            done = torch.stack([span.exit.exited.all() for span in adaptive]).tolist()
            for span, d in zip(adaptive, done):
                span.finished = d
            return
        for span in adaptive:
            seq = seq_of[id(span)]
            prev, span.pending_done = span.pending_done, span.exit.exited.all()
            span.finished = span.depth + 1 >= seq.num_loops or (prev is not None and bool(prev))

    def _fill_deeper_slots(self, fills: list[tuple[Sequence, Span, torch.Tensor]]) -> None:
        """`last_exited`: a token leaving the core at depth e copies its slot e into e+1..D-1, so
        a later token at any depth reads the deepest state this token reached."""
        rows = [(seq, span, mask) for seq, span, mask in fills if span.depth + 1 < self.max_loops]
        if not rows:
            return
        kv, ps = self.kv, self.kv.page_size
        slots = torch.tensor(
            [seq.page_table[pos // ps] * ps + pos % ps for seq, span, _ in rows for pos in range(span.start, span.end)],
            dtype=torch.long,
            device=self.device,
        )
        mask = torch.cat([m for _, _, m in rows])
        slots = slots[mask]
        if slots.numel() == 0:
            return
        lowest = min(span.depth for _, span, _ in rows)
        src = torch.cat([torch.full((span.num_tokens,), span.depth) for _, span, _ in rows]).to(self.device)[mask]
        for layer, n_slots in enumerate(self.slots_per_layer):
            if n_slots != self.max_loops:  # prelude/coda layers have a single slot
                continue
            base = kv.plane_base(layer)
            k_flat, v_flat = kv.flat(layer)
            k_src, v_src = k_flat[base + src, slots], v_flat[base + src, slots]
            for d in range(lowest + 1, self.max_loops):
                deeper = src < d
                k_flat[base + d, slots[deeper]] = k_src[deeper]
                v_flat[base + d, slots[deeper]] = v_src[deeper]

    def _coda(self, exiting: list[Row]) -> RunnerOutput:
        """Run the coda where rows leave the core; logits only where a distribution is needed."""
        out = RunnerOutput()
        if not exiting:
            return out
        model = self.model
        for seq, span in exiting:  # adaptive rows read each token's state at its own exit depth
            if span.exit is not None:
                span.hidden = span.exit.hidden
                depths = span.exit.depth.tolist()
                record_exit_depths(seq, span, depths)
                out.exit_depths += depths
            else:
                out.exit_depths += [span.depth] * span.num_tokens
        if model.coda_attention:  # every exiting token writes its coda KV, later tokens read it
            coded = model.coda(
                torch.cat([span.hidden for _, span in exiting]),
                self._positions(exiting, self.device),
                self._context(exiting, core=False),
            )
            for (_, span), h in zip(exiting, self._split(exiting, coded)):
                span.hidden = h
        picks: list[torch.Tensor] = []
        prompt_parts: list[tuple[Sequence, int, int]] = []
        for seq, span in exiting:
            if seq.wants_prompt_logprobs():
                # Positions already recorded (before a preemption) are not recorded twice.
                first = max(span.start, len(seq.prompt_logprobs) - 1)
                stop = min(span.end, seq.num_prompt_tokens - 1)
                if stop > first:
                    prompt_parts.append((seq, first, stop - first))
                    picks.append(span.hidden[first - span.start : stop - span.start])
        spec: list[tuple[Span, Sequence, int]] = []
        for seq, span in exiting:
            if span.kind != "normal":  # self-speculation: every position of the row is needed
                spec.append((span, seq, span.num_tokens))
                picks.append(span.hidden)
        for seq, span in exiting:
            if span.kind == "normal" and span.end == seq.num_tokens:
                if seq.pd_role == "prefill":
                    last = span.hidden[-1:]
                    out.final_states.append((seq, last if model.coda_attention else model.coda(last, None, None)))
                    continue
                out.sample_seqs.append(seq)
                picks.append(span.hidden[-1:])
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
        for span, seq, n in spec:
            (out.draft_logits if span.kind == "draft" else out.verify_logits).append((seq, logits[offset : offset + n]))
            offset += n
        if out.sample_seqs:
            out.sample_logits = logits[offset:]
        return out
