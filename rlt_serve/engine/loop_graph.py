"""CUDA graphs of one core loop over rows of q tokens each, every row at its own depth.

Rows that leave the core at a depth decided on the device (early exit), that stop short of full
depth (self-speculation's drafts) or that resume from one (its verify rows of K tokens) cannot
run all their loops in one decode graph; they run one loop per engine step. Eagerly, such a step
launches ~12 kernels per layer from Python, which on the H200 costs several times the loop's
device time. A loop graph replays that core call: the Triton backend reads every row's depth
slot, position, KV slots and page table from device memory, so one graph per (batch size, q)
serves any mix of depths. Inputs are written the way DecodeGraphs writes them (one pinned int32
buffer, one non-blocking copy); the state goes in by a device copy, and the per-token write mask
(exited tokens write no K/V) is copied from the exit state on the device, so nothing waits on the
host. Prelude, exit rules and coda stay eager: a few kernels, once per token.

Prompt loops are graphed the same way (`prefill_graph_sizes`): a prompt chunk also runs one loop
per step, and eagerly a 512-token prompt on Ouro-1.4B took ~50 ms to its first token on an H100
against ~12 ms of kernels, the host launching ~1000 kernels. Rows of up to `prompt_rows` (the
chunks of a wavefront) are each padded to the smallest captured token count that holds the
longest; padding tokens have no query, write no K/V, and their outputs are dropped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlt_serve.attention.backend import AttentionMetadata
from rlt_serve.engine.cuda_graph import PROMPT_GRAPH_TOKENS, capture, default_sizes
from rlt_serve.host_copy import to_device
from rlt_serve.models.base import CoreOutput
from rlt_serve.models.layers import CoreContext

if TYPE_CHECKING:
    from rlt_serve.engine.model_runner import ModelRunner
    from rlt_serve.engine.scheduler import Row


class LoopGraphs:
    """One captured core loop per (batch size, tokens per row), and per padded prompt shape.
    `capture=False` runs the same buffered call eagerly (the CPU tests check the buffers with
    Triton's interpreter that way)."""

    def __init__(self, runner: "ModelRunner", row_tokens: list[int], capture: bool = True,
                 pool: tuple | None = None, prompt_tokens: list[int] | None = None) -> None:  # fmt: skip
        ec, mc = runner.engine_config, runner.model_config
        self.runner = runner
        self.sizes = sorted(set(ec.cuda_graph_sizes or default_sizes(ec.max_num_seqs)))
        self.row_tokens = sorted(set(row_tokens))
        # Padded prompt calls (rows, tokens a row): one chunk, or 2 or 4 of a wavefront, those of
        # several rows only up to PROMPT_GRAPH_TOKENS in all (past it the kernels outlast the launches).
        self.prompt_tokens = sorted(set(prompt_tokens or []))
        self.prompt_rows = [r for r in (1, 2, 4) if r <= max(1, mc.num_loops)] if self.prompt_tokens else []
        most = min(ec.max_num_batched_tokens, PROMPT_GRAPH_TOKENS)
        self.prompt_shapes = {(r, q) for q in self.prompt_tokens for r in self.prompt_rows if r == 1 or r * q <= most}
        b_max, ps = max([self.sizes[-1], *self.prompt_rows]), runner.kv.page_size
        t_max = max([self.sizes[-1] * q for q in self.row_tokens] + [r * q for r, q in self.prompt_shapes] + [1])
        self.width = -(-min(ec.max_model_len or mc.max_position_embeddings, runner.kv.num_pages * ps) // ps)
        self.size = {"pos": t_max, "slot": t_max, "mask": t_max, "depth": t_max, "rows": 4 * b_max,
                     "table": b_max * self.width}  # fmt: skip
        self.off, total = {}, 0
        for name, n in self.size.items():
            self.off[name], total = total, total + n
        pin = runner.device.type == "cuda"
        self.host = torch.zeros(total, dtype=torch.int32, pin_memory=pin)
        self.np = self.host.numpy()
        self.dev = self.host.to(runner.device) if pin else self.host.clone()  # never aliased, as on a GPU
        dt, dev = runner.dtype, runner.device
        self.hidden = torch.zeros(t_max, mc.hidden_size, dtype=dt, device=dev)
        self.injected = torch.zeros(t_max, mc.hidden_size, dtype=dt, device=dev) if runner.model.injects_prelude else None
        self._copied = torch.cuda.Event() if pin else None
        self.capture = capture
        self._tiles: dict[tuple[int, int], dict[int, tuple[torch.Tensor, int]]] = {}
        # (rows, tokens a row, padded prompt call) -> graph and its outputs
        self.graphs: dict[tuple[int, int, bool], tuple[torch.cuda.CUDAGraph, CoreOutput]] = {}
        self.capture_seconds = 0.0
        if capture:
            t0 = time.perf_counter()
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            shapes = [(b, q, False) for q in self.row_tokens for b in self.sizes]
            shapes += [(r, q, True) for r, q in self.prompt_shapes]
            with torch.inference_mode():
                for b, q, prompt in sorted(shapes, key=lambda x: -x[0] * x[1]):  # largest first: smaller graphs reuse its pool memory
                    self._capture(b, q, prompt)
            self.capture_seconds = time.perf_counter() - t0

    def _view(self, name: str) -> np.ndarray:
        return self.np[self.off[name] : self.off[name] + self.size[name]]

    def _dev(self, name: str, n: int) -> torch.Tensor:
        return self.dev[self.off[name] : self.off[name] + n]

    def _tiles_for(self, b: int, q: int) -> dict[int, tuple[torch.Tensor, int]]:
        """The backend's query tiles of b rows of q tokens, built once: constant per shape."""
        from rlt_serve.attention.triton_backend import tile_shape

        if (b, q) not in self._tiles:
            mc = self.runner.model_config
            prompt_rows = getattr(self.runner.backend, "prompt_rows", lambda dtype: 0)(self.hidden.dtype)
            _, tok_m = tile_shape(q, mc.num_attention_heads // mc.num_key_value_heads, prompt_rows)
            flat = [x for r in range(b) for off in range(0, q, tok_m) for x in (r, off)]
            tiles = torch.tensor(flat, dtype=torch.int32).to(self.runner.device)
            self._tiles[(b, q)] = {tok_m: (tiles, len(flat) // 2)}
        return self._tiles[(b, q)]

    def _forward(self, b: int, q: int, prompt: bool = False) -> CoreOutput:
        """The core call a graph records, over the first b rows (b * q tokens) of the buffers.
        A prompt call sizes its key-range splits for a fresh prompt of q tokens (the kernels split
        each row's actual context, so any count is correct; a long prefix only runs slower)."""
        from rlt_serve.attention.triton_backend import TritonCallData

        runner, b_max, t = self.runner, self.size["rows"] // 4, b * q
        pos, slot, mask, depth = (self._dev(f, t) for f in ("pos", "slot", "mask", "depth"))
        data = TritonCallData(
            rows=self._dev("rows", 4 * b_max).view(b_max, 4)[:b],
            table=self._dev("table", b_max * self.width).view(b_max, self.width)[:b],
            write_mask=mask, num_query=[q] * b, max_end=q if prompt else self.width * runner.kv.page_size,
            tiles=dict(self._tiles_for(b, q)),
        )  # fmt: skip
        meta = AttentionMetadata(rows=[], query_start=[], slot_mapping=slot, token_depth_slot=depth, extra=data)
        injected = self.injected[:t] if self.injected is not None else None
        return runner.model.core(self.hidden[:t], injected, pos, CoreContext(runner.backend, runner.kv, meta))

    def _capture(self, b: int, q: int, prompt: bool = False) -> None:
        self._tiles_for(b, q)  # built outside the graph: a host-to-device copy cannot be captured
        self.graphs[(b, q, prompt)] = capture(lambda: self._forward(b, q, prompt), self.pool)

    def shape(self, rows: list["Row"]) -> tuple[int, int, bool] | None:
        """(rows, tokens a row, padded prompt call) of the graph that runs `rows`, or None."""
        n, q = len(rows), max(span.num_tokens for _, span in rows)
        if q in self.row_tokens and n <= self.sizes[-1] and all(span.num_tokens == q for _, span in rows):
            return next(s for s in self.sizes if s >= n), q, False
        if not self.prompt_tokens or n > self.prompt_rows[-1] or q > self.prompt_tokens[-1]:
            return None
        b = next(r for r in self.prompt_rows if r >= n)
        fits = [p for p in self.prompt_tokens if p >= q and (b, p) in self.prompt_shapes]
        return (b, fits[0], True) if fits else None

    def run(self, rows: list["Row"], hidden: torch.Tensor, injected: torch.Tensor | None,
            write_mask: torch.Tensor | None) -> CoreOutput | None:  # fmt: skip
        """One core loop of `rows` (at their own depths); None when no graph holds the call. Row
        i takes tokens [i * q, i * q + its tokens) of the padded call. The outputs are copies:
        the next replay reuses the graph's buffers."""
        shape = self.shape(rows)
        if shape is None:
            return None
        b, q, prompt = shape
        runner, ps, off, host = self.runner, self.runner.kv.page_size, self.off, self.np
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        lens = [span.num_tokens for _, span in rows] + [0] * (b - len(rows))
        # Row i's tokens are [i * q, i * q + its tokens): contiguous unless a row before the last is short.
        padded = any(span.num_tokens != q for _, span in rows[:-1])
        pos, slot_ids, mask, depth = [], [], [], []
        slots = [runner.depth_slot(span.depth) for _, span in rows]
        for (seq, span), s in zip(rows, slots):
            fill = [0] * (q - span.num_tokens)
            pos += list(range(span.start, span.end)) + fill
            slot_ids += [seq.page_table[p // ps] * ps + p % ps for p in range(span.start, span.end)] + fill
            mask += [1] * span.num_tokens + fill
            depth += [s] * q
        pad = [0] * ((b - len(rows)) * q)
        host[off["pos"] : off["pos"] + b * q] = pos + pad
        host[off["slot"] : off["slot"] + b * q] = slot_ids + pad
        host[off["mask"] : off["mask"] + b * q] = mask + pad
        host[off["depth"] : off["depth"] + b * q] = depth + pad
        recs = self._view("rows").reshape(-1, 4)
        pad_rows = [0] * (b - len(rows))
        recs[:b, 0] = np.arange(b) * q  # q_start
        recs[:b, 1] = lens  # padding rows have no query and write nothing
        recs[:b, 2] = [span.start for _, span in rows] + pad_rows
        recs[:b, 3] = slots + pad_rows
        table = self._view("table").reshape(-1, self.width)
        for i, (seq, _) in enumerate(rows):
            table[i, : len(seq.page_table)] = seq.page_table
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        t = sum(lens)
        index = None  # padded: token j of row i sits at i * q + j
        if padded:
            index = to_device([i * q + j for i, k in enumerate(lens) for j in range(k)], torch.long, runner.device)

        def place(dst: torch.Tensor, src: torch.Tensor) -> None:
            dst.index_copy_(0, index, src.to(dst.dtype)) if index is not None else dst[:t].copy_(src)

        def take(x: torch.Tensor) -> torch.Tensor:
            return x.index_select(0, index) if index is not None else x[:t].clone()

        if write_mask is not None:  # exited tokens write no K/V: the flags stay on the device
            place(self._dev("mask", b * q), write_mask)
        place(self.hidden, hidden)
        if self.injected is not None:
            place(self.injected, injected)
        if not self.capture:
            out = self._forward(b, q, prompt)
        else:
            graph, out = self.graphs[(b, q, prompt)]
            graph.replay()
        return CoreOutput(take(out.hidden), take(out.gate_logits) if out.gate_logits is not None else None)
