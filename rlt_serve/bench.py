"""`rlt-serve bench`: offline throughput and latency, judged against the DESIGN §5 roofline.

A workload is `num_prompts` random-token prompts of `input_len` tokens, each generating exactly
`output_len` tokens (ignore_eos), at most `concurrency` running at once (the engine's
max_num_seqs). Warm-up runs (one wave, 8 output tokens: Triton compilation, allocator growth) are
excluded; the table shows the median of the measured runs, each with fresh prompts so the prefix
cache never hits.

The floors and ceilings come from the checkpoint itself: its parameter count split into the core
(read once per loop), the head (final norm and lm_head, once per token) and the embedding (one row
per token, ignored), its loops, and the measured H200 peaks (4.2 TB/s copy, 790 TFLOP/s bf16
matmul). A decode step reads the core weights once per loop whatever the batch, plus every row's
KV of its depth's plane: at high concurrency the KV reads, not the weights, set the floor, so both
are shown. The end-to-end ceiling is the one the issue defines: prefill at peak matmul rate plus
each decode step at the weight-read floor.
"""

from __future__ import annotations

import copy
import gc
import math
import random
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch
from safetensors import safe_open

from rlt_serve.config import ModelConfig
from rlt_serve.loader import checkpoint_files

H200_BANDWIDTH = 4.2e12  # bytes/s, measured device copy
H200_BF16_FLOPS = 790e12  # FLOP/s, measured bf16 matmul


@dataclass
class Roofline:
    """Bytes and FLOPs of one token, from the checkpoint's parameter count."""

    total_params: int
    core_params: int  # the looped layers, applied once per loop
    head_params: int  # final norm, exit gate, lm_head (Huginn: prelude, coda): once per token
    embed_params: int
    loops: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    itemsize: int
    bandwidth: float = H200_BANDWIDTH
    flops: float = H200_BF16_FLOPS
    kv_itemsize: int | None = None  # bytes per stored K/V value (kv_cache_dtype); None: itemsize

    @classmethod
    def from_checkpoint(
        cls, model_dir: str, cfg: ModelConfig, dtype: torch.dtype, loops: int,
        kv_dtype: torch.dtype | None = None, **peaks: float,
    ) -> Roofline:  # fmt: skip
        core = head = embed = 0
        has_lm_head = False
        files = checkpoint_files(model_dir)
        for path in sorted(set(files.values())):
            with safe_open(path, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118  (a safe_open handle, not a dict)
                    n = math.prod(f.get_slice(key).get_shape())
                    if "freqs_cis" in key or "inv_freq" in key:  # RoPE tables, not weights
                        continue
                    if key.startswith("model.layers.") or ".core_block." in key or ".adapter." in key:
                        core += n
                    elif "embed_tokens" in key or key.endswith(".wte.weight"):
                        embed += n
                    else:  # Huginn's prelude and coda run once per token too
                        head += n
                        has_lm_head |= key == "lm_head.weight"
        total = core + head + embed
        if cfg.tie_word_embeddings and not has_lm_head:
            head += embed  # the output projection reads the whole (tied) embedding
        itemsize = torch.empty((), dtype=dtype).element_size()
        return cls(total, core, head, embed, loops, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, itemsize, **peaks,
                   kv_itemsize=kv_dtype.itemsize if kv_dtype is not None else None)  # fmt: skip

    @property
    def weight_bytes_per_step(self) -> int:
        """Weights one decode step reads: the core once per loop, the head once."""
        return (self.loops * self.core_params + self.head_params) * self.itemsize

    def kv_bytes(self, context: float) -> float:
        """KV one decode token reads over all its loops at `context` positions."""
        kv_itemsize = self.kv_itemsize or self.itemsize
        return self.loops * self.layers * 2 * self.kv_heads * self.head_dim * kv_itemsize * context

    def attn_flops(self, query_positions: float) -> float:
        """QK^T and PV over all loops for queries that see `query_positions` keys in total."""
        return self.loops * self.layers * 4 * self.heads * self.head_dim * query_positions

    def decode_flops(self, context: float) -> float:
        return 2 * (self.loops * self.core_params + self.head_params) + self.attn_flops(context)

    def prefill_flops(self, prompt_len: int) -> float:
        """One prompt: every position through every loop, logits at the last position only."""
        dense = 2 * (prompt_len * self.loops * self.core_params + self.head_params)
        return dense + self.attn_flops(prompt_len * (prompt_len + 1) / 2)

    def step_floor(self, batch: int, context: float, with_kv: bool) -> float:
        """Seconds for one decode step of `batch` tokens: the slower of reading and computing."""
        read = self.weight_bytes_per_step + (batch * self.kv_bytes(context) if with_kv else 0)
        return max(read / self.bandwidth, batch * self.decode_flops(context) / self.flops)


@dataclass
class RunResult:
    wall_s: float
    output_tokens: int
    ttft_s: list[float]
    tpot_s: list[float]  # per request: (last token - first token) / (n - 1)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s


@dataclass
class BenchConfig:
    model: str
    concurrency: int = 1
    num_prompts: int | None = None  # default: concurrency
    input_len: int = 512
    output_len: int = 128
    runs: int = 3
    warmup: int = 1
    warmup_output_len: int = 8  # output tokens per warm-up request (capped at output_len)
    attention_backend: str = "auto"
    kv_cache_dtype: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    max_num_batched_tokens: int = 8192
    long_prefill_token_threshold: int = 2048
    num_kv_pages: int | None = None
    num_loops: int | None = None
    enforce_eager: bool = False
    async_scheduling: bool = False  # launch step N+1 before reading step N's tokens
    prefill_tokens: int = 0  # also time one prompt batch of at least this many tokens (0: skip)
    reference: bool = True
    reference_runs: int = 1
    seed: int = 0
    peak_flops: float = H200_BF16_FLOPS
    peak_bandwidth: float = H200_BANDWIDTH
    num_speculative_tokens: int = 0  # self-speculation: K (0: off)
    speculative_draft_depth: int = 1
    speculative_adaptive: bool = False
    exit_threshold: float | None = None  # Ouro Q-exit (< 1 runs kv_layout="last_exited")
    baseline: bool = False  # also measure plain decoding of the same workload: speedup column


def engine_args(cfg: BenchConfig, plain: bool = False) -> dict[str, Any]:
    """LLMEngine arguments for the workload; `plain` drops speculation (the speedup baseline)."""
    checkpoint_loops = ModelConfig.from_pretrained(cfg.model).num_loops
    spec = {} if plain or not cfg.num_speculative_tokens else dict(
        num_speculative_tokens=cfg.num_speculative_tokens, speculative_draft_depth=cfg.speculative_draft_depth,
        speculative_adaptive=cfg.speculative_adaptive)
    return dict(
        dtype=cfg.dtype,
        device=cfg.device,
        skip_tokenizer_init=True,
        attention_backend=cfg.attention_backend,
        kv_cache_dtype=cfg.kv_cache_dtype,
        gpu_memory_utilization=0.6,  # leaves room for the reference run in the same process
        max_num_seqs=cfg.concurrency,
        max_num_batched_tokens=cfg.max_num_batched_tokens,
        long_prefill_token_threshold=min(cfg.long_prefill_token_threshold, cfg.max_num_batched_tokens),
        num_kv_pages=cfg.num_kv_pages,
        max_model_len=cfg.input_len + cfg.output_len + 1 + cfg.num_speculative_tokens,
        max_loops=max(cfg.num_loops, checkpoint_loops) if cfg.num_loops else None,
        kv_layout="last_exited" if cfg.exit_threshold is not None and cfg.exit_threshold < 1 else "separate",
        enforce_eager=cfg.enforce_eager,
        async_scheduling=cfg.async_scheduling,
        **spec,
    )


@dataclass
class DepthStats:
    """What speculation and early exit did during the measured runs (engine counter deltas)."""

    core_calls: int = 0
    output_tokens: int = 0
    drafts: int = 0  # verify rounds
    draft_tokens: int = 0
    accepted_tokens: int = 0
    sampled_loops: int = 0  # loops behind the plainly sampled tokens
    sampled_tokens: int = 0

    @classmethod
    def delta(cls, before: Any, after: Any, output_tokens: int) -> DepthStats:
        def loops(st: Any) -> tuple[int, int]:
            return sum((d + 1) * c for d, c in st.sample_depth_counts.items()), sum(st.sample_depth_counts.values())

        (l0, n0), (l1, n1) = loops(before), loops(after)
        return cls(after.num_core_calls - before.num_core_calls, output_tokens, after.num_spec_drafts - before.num_spec_drafts,
                   after.num_spec_draft_tokens - before.num_spec_draft_tokens,
                   after.num_spec_accepted_tokens - before.num_spec_accepted_tokens, l1 - l0, n1 - n0)  # fmt: skip

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (vLLM's definition: untested drafts count as proposed)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else float("nan")

    @property
    def mean_loops(self) -> float:
        """Mean loops of the state each plainly sampled token came from (early exit lowers it)."""
        return self.sampled_loops / self.sampled_tokens if self.sampled_tokens else float("nan")

    @property
    def core_calls_per_token(self) -> float:
        return self.core_calls / self.output_tokens if self.output_tokens else float("nan")


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(n)]


def start_decoding(engine: Any, prompts: list[list[int]], params: Any, prefix: str) -> None:
    """Add `prompts` as requests `prefix0..` and step until every one is decoding (prefill done),
    so what a caller times or profiles next is steady decode."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{prefix}{i}", p, params)
    while any(not s.decoding for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_engine_once(
    engine: Any, prompts: list[list[int]], output_len: int, tag: str, num_loops: int | None = None,
    exit_threshold: float | None = None,
) -> RunResult:
    """All prompts submitted at t=0; the engine's max_num_seqs bounds concurrency."""
    from rlt_serve.sampling_params import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=output_len, ignore_eos=True, detokenize=False, num_loops=num_loops,
        exit_threshold=exit_threshold,
    )
    _sync(engine.device)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}-{i}", p, params)
    first: dict[str, float] = {}
    last: dict[str, tuple[float, int]] = {}
    while engine.has_unfinished_requests():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            n = len(o.outputs[0].token_ids)
            if n and o.request_id not in first:
                first[o.request_id] = now
            if o.finished:
                last[o.request_id] = (now, n)
    _sync(engine.device)
    wall = time.perf_counter() - t0
    tpot = [(t - first[r]) / (n - 1) for r, (t, n) in last.items() if n > 1]
    return RunResult(wall, sum(n for _, n in last.values()), [t - t0 for t in first.values()], tpot)


def run_reference_once(model_dir: str, dtype: torch.dtype, device: torch.device, prompt: list[int],
                       output_len: int, num_loops: int | None, ref: Any = None) -> tuple[float, Any]:  # fmt: skip
    """Greedy by full recompute (the correctness oracle) at concurrency 1: seconds, model."""
    from rlt_serve.reference import ReferenceModel

    if ref is None:
        cpu = ReferenceModel.from_pretrained(model_dir, dtype)
        ref = ReferenceModel(cpu.config, {k: w.to(device) for k, w in cpu.weights.items()}, dtype)
    with torch.device(device):  # its forward builds positions and masks with default factories
        _sync(device)
        t0 = time.perf_counter()
        ref.greedy(prompt, output_len, num_loops)
        _sync(device)
    return time.perf_counter() - t0, ref


def count_decode_syncs(
    engine: Any, batch: int, vocab: int, steps: int = 8, sites: dict[str, int] | None = None
) -> float | None:
    """Host synchronisations per steady-state decode step (CUDA only), counted by torch's sync
    debug mode, which warns at every synchronising call (a device-to-host read, an explicit sync),
    plus async scheduling's token readbacks, which wait on an event (invisible to that mode)."""
    import warnings

    from rlt_serve.sampling_params import SamplingParams

    if engine.device.type != "cuda":
        return None
    params = SamplingParams(temperature=0.0, max_tokens=4 * steps, ignore_eos=True, detokenize=False)
    start_decoding(engine, _prompts(batch, 16, vocab, 4242), params, "sync-")
    torch.cuda.synchronize()
    pipeline = getattr(engine, "async_step", None)
    readbacks = pipeline.num_readbacks if pipeline is not None else 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            for _ in range(steps):
                engine.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    readbacks = pipeline.num_readbacks - readbacks if pipeline is not None else 0
    engine.abort_request([f"sync-{i}" for i in range(batch)])
    while engine.has_unfinished_requests():
        engine.step()
    found = [w for w in caught if "synchroniz" in str(w.message)]
    if sites is not None:
        for w in found:
            key = f"{w.filename}:{w.lineno}"
            sites[key] = sites.get(key, 0) + 1
        if readbacks:
            from rlt_serve.engine import async_step

            sites[f"{async_step.__file__}:InFlight.read (event wait)"] = readbacks
    return (len(found) + readbacks) / steps


def run_prefill_once(engine: Any, roof: "Roofline", tokens: int, input_len: int, vocab: int) -> dict[str, float]:
    """Time one batch of prompts totalling at least `tokens` (one output token each): the FLOP
    rate it reached against the peak matmul rate."""
    from rlt_serve.sampling_params import SamplingParams

    n = math.ceil(tokens / input_len)
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, detokenize=False)
    times = []
    for r in range(2):  # the first compiles any new shapes
        prompts = _prompts(n, input_len, vocab, 777 + r)
        _sync(engine.device)
        t0 = time.perf_counter()
        for i, p in enumerate(prompts):
            engine.add_request(f"prefill{r}-{i}", p, params)
        while engine.has_unfinished_requests():
            engine.step()
        _sync(engine.device)
        times.append(time.perf_counter() - t0)
    flops = n * roof.prefill_flops(input_len)
    return {"tokens": n * input_len, "seconds": times[-1], "tflops": flops / times[-1] / 1e12,
            "fraction_of_peak": flops / times[-1] / roof.flops}


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


def measure(engine: Any, cfg: BenchConfig, exit_threshold: float | None) -> tuple[list[RunResult], DepthStats]:
    """Warm-up then measured runs of the workload on `engine`; the runs and what depth did."""
    n_prompts = cfg.num_prompts or cfg.concurrency
    vocab = engine.model_config.vocab_size
    runs: list[RunResult] = []
    before = None
    for r in range(cfg.warmup + cfg.runs):
        # A warm-up compiles kernels and grows the allocator: one wave of the same shapes, with few
        # output tokens, is enough and keeps the bench short.
        warm = r < cfg.warmup
        n, out = (min(n_prompts, cfg.concurrency), min(cfg.output_len, cfg.warmup_output_len)) if warm \
            else (n_prompts, cfg.output_len)
        if not warm and before is None:
            before = copy.deepcopy(engine.stats())
        prompts = _prompts(n, cfg.input_len, vocab, cfg.seed * 1000 + r)
        res = run_engine_once(engine, prompts, out, f"run{r}", cfg.num_loops, exit_threshold)
        if not warm:
            runs.append(res)
    depth = DepthStats.delta(before, engine.stats(), sum(r.output_tokens for r in runs))
    return runs, depth


def free_device_memory(device: torch.device) -> None:
    """After the last reference to an engine is dropped: give its device memory back before the
    next engine is built in this process."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench(cfg: BenchConfig) -> dict[str, Any]:
    """Run the workload; return the measurements, floors and the rendered table."""
    from rlt_serve.engine.llm_engine import LLMEngine

    n_prompts = cfg.num_prompts or cfg.concurrency
    engine = LLMEngine(cfg.model, **engine_args(cfg))
    mc = engine.model_config
    loops = cfg.num_loops or mc.num_loops
    roof = Roofline.from_checkpoint(cfg.model, mc, engine.dtype, loops, kv_dtype=engine.runner.kv.dtype,
                                    bandwidth=cfg.peak_bandwidth, flops=cfg.peak_flops)  # fmt: skip
    runs, depth = measure(engine, cfg, cfg.exit_threshold)
    backend = engine.runner.backend
    result: dict[str, Any] = {
        "config": asdict(cfg),
        "model": {"type": mc.model_type, "params": roof.total_params, "loops": loops, "dtype": str(engine.dtype),
                  "kv_dtype": str(engine.runner.kv.dtype)},
        "device": str(engine.device),
        "backend": {"name": backend.name, "reason": backend.reason, "kernel": getattr(backend, "kernel", backend.name)},
        "roofline": asdict(roof),
        "runs": [asdict(r) | {"output_tps": r.output_tps} for r in runs],
        "depth": asdict(depth) | {"acceptance_rate": depth.acceptance_rate, "mean_loops": depth.mean_loops,
                                  "core_calls_per_token": depth.core_calls_per_token},
    }
    engine_dtype, engine_device = engine.dtype, engine.device
    result |= _summary(cfg, roof, runs, n_prompts)
    after = engine.stats()  # over every step, warm-up included
    fused = after.num_fused_decode_steps
    result["graphs"] = {
        "sizes": engine.runner.graphs.sizes if engine.runner.graphs is not None else [],
        "disabled": engine.runner.graphs_disabled,
        "fused_decode_steps": fused,
        "replays": after.num_cuda_graph_replays,
        "loop_calls": after.num_loop_calls,  # one-loop core calls: prompt chunks, drafts, early-exit rows
        "loop_replays": after.num_loop_graph_replays,
    }
    sites: dict[str, int] = {}
    result["host_syncs_per_decode_step"] = count_decode_syncs(engine, min(n_prompts, cfg.concurrency), mc.vocab_size,
                                                              sites=sites)  # fmt: skip
    result["host_sync_sites"] = sites
    if cfg.prefill_tokens:
        result["prefill"] = run_prefill_once(engine, roof, cfg.prefill_tokens, cfg.input_len, mc.vocab_size)
    adaptive = bool(cfg.num_speculative_tokens) or (cfg.exit_threshold is not None and cfg.exit_threshold < 1)
    if cfg.baseline and adaptive:
        if cfg.num_speculative_tokens:  # plain decoding needs an engine without speculation
            engine = None
            free_device_memory(engine_device)
            engine = LLMEngine(cfg.model, **engine_args(cfg, plain=True))
        base_runs, base_depth = measure(engine, cfg, None)
        base_tps = _median([r.output_tps for r in base_runs])
        result["baseline"] = {"output_tps": base_tps, "core_calls_per_token": base_depth.core_calls_per_token,
                              "speedup": result["measured"]["output_tps"] / base_tps}  # fmt: skip
    engine = None
    free_device_memory(engine_device)
    if cfg.reference:
        prompt = _prompts(1, cfg.input_len, mc.vocab_size, cfg.seed * 1000 + 999)[0]
        ref, times = None, []
        for _ in range(cfg.reference_runs):
            t, ref = run_reference_once(cfg.model, engine_dtype, engine_device, prompt, cfg.output_len,
                                        cfg.num_loops, ref)  # fmt: skip
            times.append(t)
        result["reference"] = {"runs_s": times, "output_tps": cfg.output_len / _median(times)}
    result["table"] = render(result)
    return result


def _summary(cfg: BenchConfig, roof: Roofline, runs: list[RunResult], n_prompts: int) -> dict[str, Any]:
    ctx = cfg.input_len + cfg.output_len / 2  # mean context a decode token attends to
    c = min(cfg.concurrency, n_prompts)
    waves = math.ceil(n_prompts / c)
    decode_steps = waves * max(0, cfg.output_len - 1)
    prefill_floor = n_prompts * roof.prefill_flops(cfg.input_len) / roof.flops
    total_out = n_prompts * cfg.output_len
    ceil_w = total_out / (prefill_floor + decode_steps * roof.step_floor(c, ctx, with_kv=False))
    ceil_kv = total_out / (prefill_floor + decode_steps * roof.step_floor(c, ctx, with_kv=True))
    return {
        "measured": {
            "wall_s": _median([r.wall_s for r in runs]),
            "output_tps": _median([r.output_tps for r in runs]),
            "tpot_ms": 1e3 * _median([_median(r.tpot_s) for r in runs]),
            "ttft_ms": 1e3 * _median([_median(r.ttft_s) for r in runs]),
        },
        "floors": {
            "decode_ms_weights": 1e3 * roof.step_floor(c, ctx, with_kv=False),
            "decode_ms_weights_kv": 1e3 * roof.step_floor(c, ctx, with_kv=True),
            "prefill_ms_one_prompt": 1e3 * roof.prefill_flops(cfg.input_len) / roof.flops,
            "ceiling_tps_weights": ceil_w,
            "ceiling_tps_weights_kv": ceil_kv,
            "weight_gb_per_step": roof.weight_bytes_per_step / 1e9,
            "decode_gflop_per_token": roof.decode_flops(ctx) / 1e9,
        },
    }


def render(res: dict[str, Any]) -> str:
    cfg, m, f = res["config"], res["measured"], res["floors"]
    n = cfg["num_prompts"] or cfg["concurrency"]
    b = res["backend"]
    lines = [
        (
            f"model {cfg['model']}: {res['model']['type']}, {res['model']['params'] / 1e6:.1f}M params, "
            f"{res['model']['loops']} loops, {res['model']['dtype']}, KV {res['model'].get('kv_dtype', 'same')}, "
            f"device {res['device']}"
        ),
        f"attention backend {b['name']} [{b['kernel']}] ({b['reason']})",
        (
            f"workload: concurrency {cfg['concurrency']}, {n} prompts x {cfg['input_len']} tokens, "
            f"{cfg['output_len']} output tokens each (ignore_eos); median of {len(res['runs'])} runs "
            f"after {cfg['warmup']} warm-up" + ("; async scheduling" if cfg.get("async_scheduling") else "")
        ),
        (
            f"roofline: {f['weight_gb_per_step']:.3g} GB weights per decode step, "
            f"{f['decode_gflop_per_token']:.3g} GFLOP per decoded token; peaks "
            f"{cfg['peak_bandwidth'] / 1e12:.1f} TB/s, {cfg['peak_flops'] / 1e12:.0f} TFLOP/s"
        ),
        "",
        f"{'metric':<34}{'measured':>12}{'floor/ceiling':>16}{'fraction':>10}",
    ]

    def row(name: str, value: float, bound: float, lower_is_better: bool) -> None:
        frac = bound / value if lower_is_better else value / bound
        lines.append(f"{name:<34}{value:>12.4g}{bound:>16.4g}{frac:>10.1%}")

    row("decode ms/token (weights floor)", m["tpot_ms"], f["decode_ms_weights"], True)
    row("decode ms/token (weights+KV)", m["tpot_ms"], f["decode_ms_weights_kv"], True)
    if cfg["concurrency"] == 1:
        row("TTFT ms (prefill at peak FLOPs)", m["ttft_ms"], f["prefill_ms_one_prompt"], True)
    else:
        lines.append(f"{'TTFT ms (median, incl. queueing)':<34}{m['ttft_ms']:>12.4g}")
    row("output tok/s (issue ceiling)", m["output_tps"], f["ceiling_tps_weights"], False)
    row("output tok/s (ceiling with KV)", m["output_tps"], f["ceiling_tps_weights_kv"], False)
    lines.append(f"{'wall s (median)':<34}{m['wall_s']:>12.4g}")
    g = res.get("graphs")
    if g:
        hit = g["replays"] / g["fused_decode_steps"] if g["fused_decode_steps"] else float("nan")
        why = f" (none: {g['disabled']})" if g["disabled"] else f" sizes {g['sizes'][0]}..{g['sizes'][-1]}"
        lines.append(f"{'CUDA-graph hit rate (decode steps)':<34}{hit:>12.1%}   {g['replays']}/{g['fused_decode_steps']}{why}")
        if g.get("loop_calls"):
            hit = g["loop_replays"] / g["loop_calls"]
            lines.append(f"{'  ... of one-loop calls':<34}{hit:>12.1%}   {g['loop_replays']}/{g['loop_calls']}"
                         " (prompt chunks, drafts, early-exit rows)")
    if res.get("host_syncs_per_decode_step") is not None:
        where = ", ".join(f"{k.rsplit('/', 1)[-1]} x{v}" for k, v in res.get("host_sync_sites", {}).items())
        lines.append(f"{'host syncs per decode step':<34}{res['host_syncs_per_decode_step']:>12.3g}   {where}")
    if "prefill" in res:
        p = res["prefill"]
        lines.append(
            f"{'prefill TFLOP/s (' + str(p['tokens']) + ' tokens)':<34}{p['tflops']:>12.4g}"
            f"{cfg['peak_flops'] / 1e12:>16.4g}{p['fraction_of_peak']:>10.1%}"
        )
    d = res["depth"]
    lines.append(f"{'core calls per output token':<34}{d['core_calls_per_token']:>12.4g}")
    if cfg["num_speculative_tokens"]:
        mode = "adaptive" if cfg["speculative_adaptive"] else f"draft depth {cfg['speculative_draft_depth']}"
        lines.append(f"{'spec acceptance (K=' + str(cfg['num_speculative_tokens']) + ', ' + mode + ')':<34}"
                     f"{d['acceptance_rate']:>12.3f}  ({d['accepted_tokens']}/{d['draft_tokens']} in {d['drafts']} rounds)")
    if cfg["exit_threshold"] is not None:
        lines.append(f"{'mean loops per sampled token':<34}{d['mean_loops']:>12.3f}  (exit_threshold {cfg['exit_threshold']})")
    if "baseline" in res:
        b = res["baseline"]
        lines.append(f"{'plain decoding tok/s':<34}{b['output_tps']:>12.4g}{'speedup':>16}{b['speedup']:>9.2f}x")
    if "reference" in res:
        ref = res["reference"]
        lines.append(
            f"{'reference c=1 tok/s (recompute)':<34}{ref['output_tps']:>12.4g}"
            f"{'engine/reference':>16}{m['output_tps'] / ref['output_tps']:>9.1f}x"
        )
    return "\n".join(lines)
