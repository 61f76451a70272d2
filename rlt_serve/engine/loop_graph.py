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
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from rlt_serve.attention.backend import AttentionMetadata
from rlt_serve.engine.cuda_graph import capture, default_sizes
from rlt_serve.models.base import CoreOutput
from rlt_serve.models.layers import CoreContext

if TYPE_CHECKING:
    from rlt_serve.engine.model_runner import ModelRunner
    from rlt_serve.engine.scheduler import Row


class LoopGraphs:
    """One captured core loop per (batch size, tokens per row). `capture=False` runs the same
    buffered call eagerly (the CPU tests check the buffers with Triton's interpreter that way)."""

    def __init__(self, runner: "ModelRunner", row_tokens: list[int], capture: bool = True,
                 pool: tuple | None = None) -> None:  # fmt: skip
        ec, mc = runner.engine_config, runner.model_config
        self.runner = runner
        self.sizes = sorted(set(ec.cuda_graph_sizes or default_sizes(ec.max_num_seqs)))
        self.row_tokens = sorted(set(row_tokens))
        b_max, q_max, ps = self.sizes[-1], self.row_tokens[-1], runner.kv.page_size
        t_max = b_max * q_max
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
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, CoreOutput]] = {}
        self.capture_seconds = 0.0
        if capture:
            t0 = time.perf_counter()
            self.pool = pool if pool is not None else torch.cuda.graph_pool_handle()
            with torch.inference_mode():
                for q in reversed(self.row_tokens):  # largest first: smaller graphs reuse its pool memory
                    for b in reversed(self.sizes):
                        self._capture(b, q)
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

    def _forward(self, b: int, q: int) -> CoreOutput:
        """The core call a graph records, over the first b rows (b * q tokens) of the buffers."""
        from rlt_serve.attention.triton_backend import TritonCallData

        runner, b_max, t = self.runner, self.sizes[-1], b * q
        pos, slot, mask, depth = (self._dev(f, t) for f in ("pos", "slot", "mask", "depth"))
        data = TritonCallData(
            rows=self._dev("rows", 4 * b_max).view(b_max, 4)[:b],
            table=self._dev("table", b_max * self.width).view(b_max, self.width)[:b],
            write_mask=mask, num_query=[q] * b, max_end=self.width * runner.kv.page_size,
            tiles=dict(self._tiles_for(b, q)),
        )  # fmt: skip
        meta = AttentionMetadata(rows=[], query_start=[], slot_mapping=slot, token_depth_slot=depth, extra=data)
        injected = self.injected[:t] if self.injected is not None else None
        return runner.model.core(self.hidden[:t], injected, pos, CoreContext(runner.backend, runner.kv, meta))

    def _capture(self, b: int, q: int) -> None:
        self._tiles_for(b, q)  # built outside the graph: a host-to-device copy cannot be captured
        self.graphs[(b, q)] = capture(lambda: self._forward(b, q), self.pool)

    def run(self, rows: list["Row"], hidden: torch.Tensor, injected: torch.Tensor | None,
            write_mask: torch.Tensor | None) -> CoreOutput | None:  # fmt: skip
        """One core loop of `rows` (q tokens each, at their own depths); None when no graph
        holds the batch. The outputs are copies: the next replay reuses the graph's buffers."""
        n, q = len(rows), rows[0][1].num_tokens
        if n > self.sizes[-1] or q not in self.row_tokens or any(span.num_tokens != q for _, span in rows):
            return None
        b = next(s for s in self.sizes if s >= n)
        runner, ps, off, host = self.runner, self.runner.kv.page_size, self.off, self.np
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has left the host buffer
        t, pad_rows, pad = n * q, [0] * (b - n), [0] * ((b - n) * q)
        pos = [p for _, span in rows for p in range(span.start, span.end)]
        slots = [runner.depth_slot(span.depth) for _, span in rows]
        host[off["pos"] : off["pos"] + b * q] = pos + pad
        host[off["slot"] : off["slot"] + b * q] = [
            seq.page_table[p // ps] * ps + p % ps for seq, span in rows for p in range(span.start, span.end)
        ] + pad
        host[off["mask"] : off["mask"] + b * q] = [1] * t + pad
        host[off["depth"] : off["depth"] + b * q] = [s for s in slots for _ in range(q)] + pad
        recs = self._view("rows").reshape(-1, 4)
        recs[:b, 0] = np.arange(b) * q  # q_start
        recs[:b, 1] = [q] * n + pad_rows  # padding rows have no query and write nothing
        recs[:b, 2] = [span.start for _, span in rows] + pad_rows
        recs[:b, 3] = slots + pad_rows
        table = self._view("table").reshape(-1, self.width)
        for i, (seq, _) in enumerate(rows):
            table[i, : len(seq.page_table)] = seq.page_table
        self.dev.copy_(self.host, non_blocking=True)
        if self._copied is not None:
            self._copied.record()
        if write_mask is not None:  # exited tokens write no K/V: the flags stay on the device
            self._dev("mask", t).copy_(write_mask)
        self.hidden[:t].copy_(hidden)
        if self.injected is not None:
            self.injected[:t].copy_(injected)
        if not self.capture:
            out = self._forward(b, q)
        else:
            graph, out = self.graphs[(b, q)]
            graph.replay()
        gate = out.gate_logits[:t].clone() if out.gate_logits is not None else None
        return CoreOutput(out.hidden[:t].clone(), gate)
