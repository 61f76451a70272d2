"""CUDA graphs of whole decode tokens: embedding, every loop of the core, and the head.

A fixed-depth decode step launches the same kernels for every token (24 layers x 4 loops x about
a dozen kernels for Ouro-1.4B); at small batches their CPU launch cost, not the device, sets the
step time. So each step of decode tokens is one graph replay, captured per batch size (vLLM's
`cuda_graph_sizes`): the smallest captured size that holds the batch runs, its padding rows have
no query and write no KV. A graph reads its inputs from fixed device addresses, so every input
(token ids, positions, KV slots, per-depth row records, page tables) lives in one int32 device
buffer, filled from one pinned host buffer by a single non-blocking copy per step. With async
scheduling a decode token sampled by the previous step is still on the device: its id is gathered
into the static `ids` field on the device, after the copy and before the replay.

Only the Triton backend takes all of its per-call metadata from device tensors, so graphs are
captured with it; other configurations run the same fused step eagerly, and `graph_support` says
why. Prelude and coda layers (Huginn) read and write depth slot 0, the same records as loop 0. A
family whose initial state is drawn per (seed, position) on the host (Huginn) has it computed
before the replay into a static state buffer the graph reads.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Callable, TypeVar

import numpy as np
import torch

from rlt_serve.attention.backend import AttentionMetadata
from rlt_serve.engine.sequence import PLACEHOLDER_TOKEN
from rlt_serve.models.base import LoopedModel
from rlt_serve.models.layers import CoreContext

T = TypeVar("T")

if TYPE_CHECKING:
    from rlt_serve.engine.model_runner import ModelRunner
    from rlt_serve.engine.scheduler import Row


def graph_support(runner: "ModelRunner") -> str | None:
    """None when decode steps of this runner are captured as CUDA graphs, else why not."""
    ec, model = runner.engine_config, runner.model
    if runner.device.type != "cuda":
        return "not a CUDA device"
    if ec.enforce_eager:
        return "enforce_eager=True"
    if not ec.fuse_decode_loops:
        return "fuse_decode_loops=False (a decode token's loops run in separate steps)"
    if runner.backend.name != "triton":
        return f"attention backend {runner.backend.name!r} builds per-call metadata on the host (graphs need triton)"
    return None


def capture(forward: Callable[[], T], pool: tuple | None = None) -> tuple[torch.cuda.CUDAGraph, T]:
    """Record `forward` as a graph in `pool`, after one run on a side stream that compiles the
    kernels and warms cuBLAS outside it; returns the graph and its (static) outputs."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        forward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = forward()
    return graph, out


def default_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to max_num_seqs (and max_num_seqs itself), as vLLM does."""
    sizes = [b for b in (1, 2, 4) if b < max_num_seqs] + list(range(8, max_num_seqs, 8)) + [max_num_seqs]
    return sorted(set(sizes))


PROMPT_GRAPH_TOKENS = 2048  # past this a prompt loop's kernels outlast its launches: eager costs nothing


def default_prompt_sizes(chunk: int, budget: int) -> list[int]:
    """16, 24, 32, 48, 64, ...: powers of two and halfway between, up to the longest prompt chunk
    (`long_prefill_token_threshold`, within the token budget) and PROMPT_GRAPH_TOKENS; padding
    a chunk to the next size wastes at most a third of its kernels' time."""
    limit = min(chunk, budget, PROMPT_GRAPH_TOKENS)
    sizes = [q for p in range(4, 12) for q in (1 << p, 3 << (p - 1)) if q <= limit]
    return sorted(set(sizes + [limit]))


class DecodeGraphs:
    """Captured decode steps of `num_loops` loops, one graph per batch size. `capture=False` runs
    the same buffered step eagerly (the CPU tests check the buffers with Triton's interpreter)."""

    def __init__(self, runner: "ModelRunner", num_loops: int, capture: bool = True) -> None:
        ec, mc = runner.engine_config, runner.model_config
        self.runner = runner
        self.num_loops = num_loops
        self.sizes = sorted(set(ec.cuda_graph_sizes or default_sizes(ec.max_num_seqs)))
        ps = runner.kv.page_size
        max_len = min(ec.max_model_len or mc.max_position_embeddings, runner.kv.num_pages * ps)
        self.width = math.ceil(max_len / ps)  # page-table entries per row
        b_max, d = self.sizes[-1], num_loops
        fields = {"ids": b_max, "src": b_max, "pos": b_max, "slot": b_max, "mask": b_max, "tiles": 2 * b_max,
                  "rows": d * b_max * 4, "depth": d * b_max, "table": b_max * self.width}  # fmt: skip
        self.off: dict[str, int] = {}
        total = 0
        for name, n in fields.items():
            self.off[name] = total
            total += n
        cuda = runner.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=cuda)
        self.np = self.host.numpy()
        self._rows_np = self._host_view("rows", d * b_max * 4).reshape(d, b_max, 4)
        self._table_np = self._host_view("table", b_max * self.width).reshape(b_max, self.width)
        # Constant fields: row i is tile i (one query each) and at loop t reads depth slot slot(t).
        self._host_view("tiles", 2 * b_max).reshape(b_max, 2)[:, 0] = np.arange(b_max)
        self._rows_np[:, :, 0] = np.arange(b_max)[None, :]
        for t in range(d):
            self._rows_np[t, :, 3] = runner.depth_slot(t)
            self._host_view("depth", d * b_max).reshape(d, b_max)[t] = runner.depth_slot(t)
        self.dev = self.host.to(runner.device) if cuda else self.host.clone()  # never aliased, as on a GPU
        # Huginn draws each token's initial state on the host: the graph reads it from here.
        self.seeded_state = type(runner.model).initial_state is not LoopedModel.initial_state
        self.state = torch.zeros(b_max, mc.hidden_size, dtype=runner.dtype, device=runner.device)
        self._copied = torch.cuda.Event() if cuda else None
        if self._copied is not None:
            self._copied.record()
        self.capture = capture
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        if capture:
            self.pool = torch.cuda.graph_pool_handle()
            t0 = time.perf_counter()
            with torch.inference_mode():
                for b in reversed(self.sizes):  # largest first: smaller graphs reuse its pool memory
                    self._capture(b)
            self.capture_seconds = time.perf_counter() - t0

    def _host_view(self, name: str, n: int) -> np.ndarray:
        return self.np[self.off[name] : self.off[name] + n]

    def _dev_view(self, name: str, n: int) -> torch.Tensor:
        return self.dev[self.off[name] : self.off[name] + n]

    def _forward(self, b: int) -> torch.Tensor:
        """The step the graph records: logits [b, V] of b decode tokens after every loop."""
        runner, b_max, d = self.runner, self.sizes[-1], self.num_loops
        model, kv = runner.model, runner.kv
        ids, pos = self._dev_view("ids", b), self._dev_view("pos", b)
        slot, mask = self._dev_view("slot", b), self._dev_view("mask", b)
        tiles = self._dev_view("tiles", 2 * b_max).view(b_max, 2)[:b]
        rows = self._dev_view("rows", d * b_max * 4).view(d, b_max, 4)
        depth = self._dev_view("depth", d * b_max).view(d, b_max)
        table = self._dev_view("table", b_max * self.width).view(b_max, self.width)[:b]
        from rlt_serve.attention.triton_backend import TritonCallData

        def context(t: int) -> CoreContext:  # loop t's records; prelude and coda use slot 0 = loop 0's
            data = TritonCallData(
                rows=rows[t, :b], table=table, write_mask=mask, num_query=[1] * b,
                max_end=self.width * kv.page_size, decode_tiles=tiles,
            )  # fmt: skip
            meta = AttentionMetadata(rows=[], query_start=[], slot_mapping=slot, token_depth_slot=depth[t, :b], extra=data)
            return CoreContext(runner.backend, kv, meta)

        pre = model.prelude(ids, pos, context(0) if model.prelude_attention else None)
        hidden = self.state[:b] if self.seeded_state else pre.hidden
        for t in range(d):
            hidden = model.core(hidden, pre.injected, pos, context(t)).hidden
        coded = model.coda(hidden, pos, context(0)) if model.coda_attention else model.coda(hidden, None, None)
        return model.compute_logits(coded)

    def _capture(self, b: int) -> None:
        self.graphs[b] = capture(lambda: self._forward(b), self.pool)

    def run(self, rows: list["Row"], num_loops: int) -> torch.Tensor | None:
        """Logits [len(rows), V] of one decode step, or None when no graph fits the batch."""
        n = len(rows)
        if num_loops != self.num_loops or n > self.sizes[-1]:
            return None
        b = next(s for s in self.sizes if s >= n)
        ps, off, host = self.runner.kv.page_size, self.off, self.np
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        positions = [span.start for _, span in rows]
        tables = [seq.page_table for seq, _ in rows]
        ids = [(seq.output_token_ids or seq.prompt_token_ids)[-1] for seq, _ in rows]
        # Padding rows too: a stale entry may be an earlier step's placeholder (-1), replaced only
        # on the device, and the graph embeds every row of its batch size.
        host[off["ids"] : off["ids"] + b] = ids + [0] * (b - n)
        # Async scheduling: a token still on the device comes from the previous step's draws (src).
        pending = self.runner.pending
        srcs = [pending.source(seq, span.start) for seq, span in rows] if pending is not None else []
        num_pending = sum(s >= 0 for s in srcs)
        if ids.count(PLACEHOLDER_TOKEN) != num_pending:
            raise AssertionError("a placeholder token reached a decode graph without a device source")
        if num_pending:
            host[off["src"] : off["src"] + n] = srcs
        host[off["pos"] : off["pos"] + b] = positions + [0] * (b - n)
        host[off["slot"] : off["slot"] + b] = [pt[p // ps] * ps + p % ps for pt, p in zip(tables, positions)] + [0] * (b - n)
        host[off["mask"] : off["mask"] + b] = [1] * n + [0] * (b - n)
        self._rows_np[:, :b, 1] = [1] * n + [0] * (b - n)
        self._rows_np[:, :b, 2] = positions + [0] * (b - n)
        for i, pt in enumerate(tables):
            self._table_np[i, : len(pt)] = pt
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if num_pending:  # the graph reads ids from its static buffer: fill it on the device
            dev_ids, src = self._dev_view("ids", n), self._dev_view("src", n)
            dev_ids.copy_(torch.where(src >= 0, pending.tokens32.index_select(0, src.clamp(min=0)), dev_ids))
        if self.seeded_state:
            from rlt_serve.models.base import PreludeOutput

            seeds = [seq.generator.initial_seed() for seq, _ in rows]
            state = self.runner.model.initial_state(PreludeOutput(self.state[:n]), seeds, torch.tensor(positions))
            if state.data_ptr() != self.state.data_ptr():
                self.state[:n].copy_(state)
        if not self.capture:
            return self._forward(b)[:n]
        graph, out = self.graphs[b]
        graph.replay()
        return out[:n]
