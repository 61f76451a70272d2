"""Tensors in, logits out: runs one step (prelude for new spans, one core call, coda for exits).

A step takes the scheduler's rows, embeds the spans that start at depth 0, runs the core once
over all rows at their own depths (each row's KV plane follows its depth), and applies the coda
only where a row leaves the core and a distribution is needed: the last position of a sequence
(to sample) and, when asked for, prompt positions (prompt_logprobs).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field, fields

import torch

from rlt_serve.attention import RowSpec, get_attention_backend
from rlt_serve.config import ConfigError, EngineConfig, ModelConfig, core_ring_slots, parse_kv_cache_dtype
from rlt_serve.engine.async_step import PendingTokens
from rlt_serve.engine.cuda_graph import DecodeGraphs, default_prompt_sizes, graph_support
from rlt_serve.engine.loop_graph import LoopGraphs
from rlt_serve.engine.kv_cache import KVCache
from rlt_serve.engine.exit_criteria import exit_step, needs_distribution, new_exit_state, record_exit_depths
from rlt_serve.engine.exit_policy import ExitReadback, ExitState, q_exit_rows, row_done_flag
from rlt_serve.engine.scheduler import Row, SchedulerOutput
from rlt_serve.engine.sequence import Sequence, Span
from rlt_serve.engine.spec_controller import draft_lengths
from rlt_serve.host_copy import to_device
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
    sample_depths: list[int] = field(default_factory=list)  # per sample_seqs: depth of the state sampled from
    draft_logits: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)  # shallow [1, V]
    verify_logits: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)  # full depth [K, V]
    # Prefill-only requests (PD): the post-coda state [1, H] of the last prompt position, which
    # the decode side feeds to `compute_logits` instead of sampling here.
    final_states: list[tuple[Sequence, torch.Tensor]] = field(default_factory=list)
    num_core_calls: int = 0  # core passes over a batch (a fused decode step counts each loop)
    num_core_tokens: int = 0  # row tokens over every core loop this step ran
    num_fused_decode: int = 0  # batches of decode tokens that ran every loop in this step
    num_graph_replays: int = 0  # ... of which replayed a CUDA graph
    num_loop_calls: int = 0  # one-loop core calls (prompt chunks, drafts, early-exit rows)
    num_loop_graph_replays: int = 0  # ... of which replayed a graph (LoopGraphs)

    def merge(self, other: "RunnerOutput") -> None:
        """Append `other` (rows disjoint from this output's) to this output: lists extend,
        counters add, and sampled rows' logits stack."""
        if other.sample_seqs:
            logits = other.sample_logits
            self.sample_logits = logits if self.sample_logits is None else torch.cat([self.sample_logits, logits])
        for f in fields(self):
            if f.name != "sample_logits":
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


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
        model.fuse_weights()
        self.model = model.eval()
        self.max_loops = engine_config.max_loops or model_config.num_loops
        # `shared` and Huginn's compress-s{k} keep a ring of slots per core layer, not one per depth.
        self.ring = core_ring_slots(model_config, engine_config)
        self.fills_deeper_slots = engine_config.kv_layout == "last_exited" or engine_config.huginn_cache == "latest-m4"
        self.slots_per_layer = model.kv_slots_per_layer(self.ring or self.max_loops)
        self.kv_dtype = parse_kv_cache_dtype(engine_config.kv_cache_dtype, dtype)
        self.kv = KVCache(
            slots_per_layer=self.slots_per_layer,
            num_pages=self._num_pages(),
            page_size=engine_config.page_size,
            kv_heads=model_config.num_key_value_heads,
            head_dim=model_config.head_dim,
            dtype=self.kv_dtype,
            device=device,
        )
        self.backend = get_attention_backend(
            engine_config.attention_backend, device, dtype, engine_config.page_size, kv_dtype=self.kv_dtype
        )
        # Async scheduling: the previous step's sampled tokens, still on the device, that this
        # step's rows take as inputs (set by AsyncStep for the duration of one execute()).
        self.pending: PendingTokens | None = None
        self.graphs: DecodeGraphs | None = None
        self.loop_graphs: LoopGraphs | None = None  # one-loop steps of one-token rows (drafts, early exit)
        self.graphs_disabled = graph_support(self)  # None when decode steps are captured
        if self.graphs_disabled is None:
            self.graphs = DecodeGraphs(self, model_config.num_loops)
            ec = engine_config
            row_tokens: list[int] = []
            if ec.num_speculative_tokens or self.fills_deeper_slots:  # rows that stop short of full depth
                verify = draft_lengths(ec.num_speculative_tokens, ec.speculative_adaptive) if ec.num_speculative_tokens else []
                row_tokens = [1, *verify]
            prompt = ec.prefill_graph_sizes
            if prompt is None:
                prompt = default_prompt_sizes(ec.long_prefill_token_threshold, ec.max_num_batched_tokens)
            if row_tokens or prompt:
                self.loop_graphs = LoopGraphs(self, row_tokens, pool=self.graphs.pool, prompt_tokens=prompt)

    def _num_pages(self) -> int:
        ec, mc = self.engine_config, self.model_config
        if ec.num_kv_pages is not None:
            return ec.num_kv_pages
        per_token = KVCache.bytes_per_token(sum(self.slots_per_layer), mc.num_key_value_heads, mc.head_dim, self.kv_dtype)
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

    def _context(self, rows: list[Row], core: bool, write_mask: torch.Tensor | None = None) -> CoreContext:
        """KV metadata of a call; a core call's write mask is `_write_mask(rows)` unless given."""
        specs = [
            RowSpec(span.num_tokens, span.start, self.depth_slot(span.depth) if core else 0, seq.page_table)
            for seq, span in rows
        ]
        if core and write_mask is None:
            write_mask = self._write_mask(rows)
        return CoreContext(self.backend, self.kv, self.backend.prepare(specs, self.kv, write_mask))

    def _write_mask(self, rows: list[Row]) -> torch.Tensor | None:
        """Per token of a core call: whether it writes K/V (exited tokens do not); None: all do."""
        if not any(span.exit is not None for _, span in rows):
            return None
        return torch.cat(
            [
                ~span.exit.exited.to(self.device) if span.exit is not None
                else torch.ones(span.num_tokens, dtype=torch.bool, device=self.device)
                for _, span in rows
            ]
        )  # fmt: skip

    @staticmethod
    def _positions(rows: list[Row], device: torch.device) -> torch.Tensor:
        return to_device([p for _, span in rows for p in range(span.start, span.end)], torch.long, device)

    @staticmethod
    def _split(rows: list[Row], t: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return t.split([span.num_tokens for _, span in rows])

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """One step: fixed-depth decode tokens run all their loops (`fuse_decode_loops`), every
        other row one loop at its own depth."""
        fused = [row for row in sched.rows if self._fusable(row)] if self.engine_config.fuse_decode_loops else []
        if not fused:
            return self._execute_loop(sched.rows)
        in_fused = {id(span) for _, span in fused}
        rest = [row for row in sched.rows if id(row[1]) not in in_fused]
        out = RunnerOutput()
        for loops in sorted({seq.num_loops for seq, _ in fused}):
            out.merge(self._decode_tokens([row for row in fused if row[0].num_loops == loops], loops))
        if rest:
            out.merge(self._execute_loop(rest))
        return out

    @staticmethod
    def _fusable(row: Row) -> bool:
        seq, span = row
        return (
            span.kind == "normal" and span.depth == 0 and span.num_tokens == 1 and span.stop_depth is None
            and seq.decoding and not seq.adaptive
        )  # fmt: skip

    def _decode_tokens(self, rows: list[Row], loops: int) -> RunnerOutput:
        """Decode tokens through every loop: one graph replay, or the same stages run eagerly."""
        logits = self.graphs.run(rows, loops) if self.graphs is not None else None
        if logits is not None:
            out = RunnerOutput([seq for seq, _ in rows], logits, exit_depths=[loops - 1] * len(rows),
                               sample_depths=[loops - 1] * len(rows))
            out.num_graph_replays = 1
        else:
            self._prelude(rows)
            positions = self._positions(rows, self.device)
            hidden = torch.cat([span.hidden for _, span in rows])
            injected = torch.cat([span.injected for _, span in rows]) if rows[0][1].injected is not None else None
            for depth in range(loops):
                for _, span in rows:
                    span.depth = depth
                hidden = self.model.core(hidden, injected, positions, self._context(rows, core=True)).hidden
            for (_, span), h in zip(rows, self._split(rows, hidden)):
                span.hidden = h
            out = self._coda(rows)
        for _, span in rows:
            span.depth, span.finished = loops - 1, True  # the scheduler's advance() retires them
        if self.fills_deeper_slots:
            self._fill_deeper_slots([(seq, span, torch.ones(1, dtype=torch.bool, device=self.device)) for seq, span in rows])
        out.num_core_calls, out.num_core_tokens = loops, len(rows) * loops
        out.num_fused_decode = 1
        return out

    def _prelude(self, starting: list[Row]) -> None:
        """Embed spans entering depth 0: their state (and Huginn's injection) goes on the span."""
        model, dev = self.model, self.device
        ids = [t for seq, span in starting for t in seq.token_ids(span.start, span.end)]
        ctx = self._context(starting, core=False) if model.prelude_attention else None
        positions = self._positions(starting, dev)
        ids_dev = to_device(ids, torch.long, dev)
        if self.pending is not None:
            ids_dev = self.pending.fill(starting, ids, ids_dev)
        pre = model.prelude(ids_dev, positions, ctx)
        seeds = [s for seq, span in starting for s in [seq.generator.initial_seed()] * span.num_tokens]
        state = model.initial_state(pre, seeds, positions)
        injected = self._split(starting, pre.injected) if pre.injected is not None else [None] * len(starting)
        for (seq, span), h, e in zip(starting, self._split(starting, state), injected):
            span.hidden, span.injected = h, e
            if seq.adaptive:
                span.exit = new_exit_state(seq, span, h)

    def _execute_loop(self, rows: list[Row]) -> RunnerOutput:
        model, dev = self.model, self.device
        starting = [(seq, span) for seq, span in rows if span.depth == 0]
        if starting:
            self._prelude(starting)
        hidden = torch.cat([span.hidden for _, span in rows])
        injected = torch.cat([span.injected for _, span in rows]) if rows[0][1].injected is not None else None
        write_mask = self._write_mask(rows)
        core = self.loop_graphs.run(rows, hidden, injected, write_mask) if self.loop_graphs else None
        graphed = core is not None
        if core is None:
            ctx = self._context(rows, core=True, write_mask=write_mask)
            core = model.core(hidden, injected, self._positions(rows, dev), ctx)
        gates = self._split(rows, core.gate_logits) if core.gate_logits is not None else [None] * len(rows)
        fills: list[tuple[Sequence, Span, torch.Tensor]] = []  # tokens that left the core now
        adaptive: list[Span] = []
        q_rows: list[tuple[Sequence, Span, torch.Tensor]] = []  # Ouro Q-exit rows, decided in one pass
        dists = self._check_logits(rows, core.hidden)
        for (seq, span), h, g in zip(rows, self._split(rows, core.hidden), gates):
            span.hidden = h
            if isinstance(span.exit, ExitState):
                q_rows.append((seq, span, h))
                adaptive.append(span)
            elif span.exit is not None:
                new = exit_step(seq, span, h, dists.get(id(span)))
                fills.append((seq, span, new))
                adaptive.append(span)
            elif span.depth + 1 == (span.stop_depth or seq.num_loops):
                span.finished = True
                if span.kind == "draft":  # its deeper loops come with the verify row
                    continue
                fills.append((seq, span, torch.ones(span.num_tokens, dtype=torch.bool, device=dev)))
        done: dict[int, torch.Tensor] = {}
        if q_rows:
            gate = torch.cat([g for (_, span), g in zip(rows, gates) if isinstance(span.exit, ExitState)])
            fills += self._q_exits(q_rows, gate, done)
        if adaptive:
            self._decide_exits(rows, adaptive, done)
        if self.fills_deeper_slots:
            self._fill_deeper_slots(fills)
        out = self._coda([(seq, span) for seq, span in rows if span.finished])
        out.num_core_calls, out.num_core_tokens = 1, sum(span.num_tokens for _, span in rows)
        out.num_loop_calls, out.num_loop_graph_replays = 1, int(graphed)
        return out

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
        last = to_device(list(itertools.accumulate(span.num_tokens for _, span in picked)), torch.long, self.device) - 1
        logits = self.model.compute_logits(coded[last])
        return {id(span): row for (_, span), row in zip(picked, logits)}

    def _q_exits(self, q_rows: list[tuple[Sequence, Span, torch.Tensor]], gate: torch.Tensor,
                 done: dict[int, torch.Tensor]) -> list[tuple[Sequence, Span, torch.Tensor]]:  # fmt: skip
        """Ouro's Q-exit rule for every such row of the call at once; fills `done` (span id ->
        [] bool, the row has left the core) and returns the rows' tokens leaving now."""
        states, news, flags = q_exit_rows(
            [span.exit for _, span, _ in q_rows], gate, torch.cat([h for _, _, h in q_rows]),
            [span.depth for _, span, _ in q_rows], [seq.params.exit_threshold for seq, _, _ in q_rows],
            [seq.params.min_loops or 1 for seq, _, _ in q_rows], [seq.num_loops for seq, _, _ in q_rows],
            self.engine_config.delayed_exit,
        )  # fmt: skip
        for (_, span, _), st, flag in zip(q_rows, states, flags):
            span.exit = st
            done[id(span)] = flag
        return [(seq, span, new) for (seq, span, _), new in zip(q_rows, news)]

    def _decide_exits(self, rows: list[Row], adaptive: list[Span], done: dict[int, torch.Tensor]) -> None:
        """Whether each adaptive row has left the core entirely (`span.finished`).

        Synchronous (default): one blocking host read per call, of this call's decisions.
        Asynchronous (`async_exit`, the exact policy): this call's flags start a non-blocking copy
        to pinned host memory and are read one call later, when they have long arrived, so the host
        never waits on the gate. A row whose tokens all exited at depth t therefore runs one more
        loop; its K/V writes are masked (exited tokens never write) and its state is never read
        (the coda reads the stored exit-depth state), so exit depths, states and tokens equal the
        synchronous policy's bit for bit. Delayed exit (`delayed_exit`) reads back the same way,
        but its decisions take effect one loop later (exit_policy), so no loop is wasted."""
        ec = self.engine_config
        delay = ec.delayed_exit
        flags = torch.stack([done[id(span)] if id(span) in done else row_done_flag(span.exit, delay) for span in adaptive])
        if not (delay or ec.async_exit):
            for span, done in zip(adaptive, flags.tolist()):
                span.finished = done
            return
        seq_of = {id(span): seq for seq, span in rows}
        readback = ExitReadback(flags)
        for i, span in enumerate(adaptive):
            prev, span.pending_done = span.pending_done, (readback, i)
            span.finished = span.depth + 1 >= seq_of[id(span)].num_loops or (prev is not None and prev[0].get(prev[1]))

    def _fill_deeper_slots(self, fills: list[tuple[Sequence, Span, torch.Tensor]]) -> None:
        """`last_exited`: a token leaving the core at depth e copies its slot e into e+1..D-1, so
        a later token at any depth reads the deepest state this token reached."""
        rows = [(seq, span, mask) for seq, span, mask in fills if span.depth + 1 < self.max_loops]
        if not rows:
            return
        kv, ps, dev = self.kv, self.kv.page_size, self.device
        slots = to_device(
            [seq.page_table[pos // ps] * ps + pos % ps for seq, span, _ in rows for pos in range(span.start, span.end)],
            torch.long, dev,
        )  # fmt: skip
        src = to_device([span.depth for _, span, _ in rows for _ in range(span.num_tokens)], torch.long, dev)
        leaving = torch.cat([m for _, _, m in rows])
        lowest = min(span.depth for _, span, _ in rows)
        # Every (core layer, deeper slot d, token) at once, with no boolean indexing (a host
        # sync on CUDA): a token that does not leave now, or is already at or below d, copies
        # its own slot onto itself, which changes nothing.
        bases = to_device([kv.plane_base(layer) for layer, n in enumerate(self.slots_per_layer) if n == self.max_loops],
                          torch.long, dev)  # fmt: skip
        depths = torch.arange(lowest + 1, self.max_loops, device=dev)
        take = leaving[None, :] & (src[None, :] < depths[:, None])  # [E, T]
        dst = bases[:, None, None] + torch.where(take, depths[:, None], src[None, :])[None]  # [L, E, T]
        src_plane = (bases[:, None] + src[None, :])[:, None, :].expand_as(dst)
        slot = slots.expand_as(dst)
        k_flat, v_flat = kv.raw_flat()
        k_flat[dst, slot] = k_flat[src_plane, slot]
        v_flat[dst, slot] = v_flat[src_plane, slot]

    def _coda(self, exiting: list[Row]) -> RunnerOutput:
        """Run the coda where rows leave the core; logits only where a distribution is needed."""
        out = RunnerOutput()
        if not exiting:
            return out
        model = self.model
        last_depth: dict[int, int] = {}  # per row: depth its last token left the core at
        for seq, span in exiting:  # adaptive rows read each token's state at its own exit depth
            if span.exit is not None:
                span.hidden = span.exit.hidden
                depths = span.exit.depth.tolist()
                record_exit_depths(seq, span, depths)
                out.exit_depths += depths
                last_depth[id(span)] = depths[-1]
            elif span.kind != "draft":  # a draft does not leave the core: its verify row resumes it
                out.exit_depths += [span.depth] * span.num_tokens
                last_depth[id(span)] = span.depth
        # What the head reads per row. With coda attention every exiting token writes its coda K/V
        # (later tokens read it); a draft's span keeps its core state, which its verify row resumes.
        out_hidden = {id(span): span.hidden for _, span in exiting}
        if model.coda_attention:
            coded = model.coda(
                torch.cat([span.hidden for _, span in exiting]),
                self._positions(exiting, self.device),
                self._context(exiting, core=False),
            )
            out_hidden = {id(span): h for (_, span), h in zip(exiting, self._split(exiting, coded))}
        picks: list[torch.Tensor] = []
        prompt_parts: list[tuple[Sequence, int, int]] = []
        for seq, span in exiting:
            if seq.wants_prompt_logprobs():
                # Positions already recorded (before a preemption) are not recorded twice.
                first = max(span.start, len(seq.prompt_logprobs) - 1)
                stop = min(span.end, seq.num_prompt_tokens - 1)
                if stop > first:
                    prompt_parts.append((seq, first, stop - first))
                    picks.append(out_hidden[id(span)][first - span.start : stop - span.start])
        spec: list[tuple[Span, Sequence, int]] = []
        for seq, span in exiting:
            if span.kind != "normal":  # self-speculation: every position of the row is needed
                spec.append((span, seq, span.num_tokens))
                picks.append(out_hidden[id(span)])
        for seq, span in exiting:
            if span.kind == "normal" and span.end == seq.num_tokens:
                if seq.pd_role == "prefill":
                    last = out_hidden[id(span)][-1:]
                    out.final_states.append((seq, last if model.coda_attention else model.coda(last, None, None)))
                    continue
                out.sample_seqs.append(seq)
                out.sample_depths.append(last_depth[id(span)])
                picks.append(out_hidden[id(span)][-1:])
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
