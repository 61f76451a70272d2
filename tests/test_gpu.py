"""On CUDA, every attention backend against the torch backend and the dense reference.

Run with `pytest -m gpu -q`. TF32 is off, so float32 runs are exact enough for greedy tokens to
match the CPU reference under the randomised batching workload of test_engine_oracle.py. The
flash-attn backend runs fp16/bf16 only, so it (and triton) are also compared in bf16 against the
torch backend: prompt logprobs teacher-forced, generated logprobs up to the first differing
token (a bf16 near-tie may legitimately flip a token).
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch
from test_engine_oracle import CONFIGS, _drive  # the CPU oracle's randomised workload

from rlt_serve.attention.backend import _missing, get_attention_backend
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.reference import ReferenceModel
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import random_attention_call

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def no_tf32() -> Iterator[None]:
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def _need(name: str, dtype: torch.dtype) -> None:
    missing = _missing(name, CUDA, dtype)
    if missing:
        pytest.skip(missing)


def test_auto_picks_triton_on_cuda():
    _need("triton", torch.bfloat16)
    assert get_attention_backend("auto", CUDA, torch.bfloat16).name == "triton"


# -- kernels, one call ----------------------------------------------------------------------
# (64, 2100): a chunk on a long prefix, where prompt tiles split their key ranges too
SPANS = [(1, 700), (300, 0), (1, 5), (64, 200), (17, 33), (1, 0), (1, 129), (64, 2100)]
DECODE = [(1, 1000), (1, 300)]  # few programs, long contexts: the split-KV path and its combine


@pytest.mark.parametrize("backend", ["triton", "flash-attn"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page_size",
    [(16, 16, 128, 16), (48, 8, 128, 16), (6, 2, 96, 1), (8, 8, 64, 16), (4, 4, 128, 256)],
)
@pytest.mark.parametrize("spans", [SPANS, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("masked", [False, True])
def test_backend_call_matches_torch(backend, dtype, heads, kv_heads, head_dim, page_size, spans, masked):
    _need(backend, dtype)
    pools, rows, (q, k, v), mask = random_attention_call(
        heads, kv_heads, head_dim, page_size, spans, 0, masked, num_pages=4500 // page_size + len(spans) + 2,
        depth_slots=4, dtype=dtype, device=CUDA,
    )
    ref = get_attention_backend("torch", CUDA, dtype, page_size)
    other = get_attention_backend(backend, CUDA, dtype, page_size)
    want = ref.forward(q, k, v, pools[0], 1, ref.prepare(rows, pools[0], mask), head_dim**-0.5)
    got = other.forward(q, k, v, pools[1], 1, other.prepare(rows, pools[1], mask), head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(pools[0].k, pools[1].k) and torch.equal(pools[0].v, pools[1].v), "KV writes differ"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,page_size", [(16, 16, 128, 16), (48, 8, 128, 16), (6, 2, 96, 1)])
@pytest.mark.parametrize("spans", [SPANS, DECODE], ids=["mixed", "decode"])
@pytest.mark.parametrize("split_target,warps_in_flight", [(None, 2048), (1, 2048), (1, 1)],
                         ids=["splits", "unsplit", "unsplit-one-warp"])
def test_triton_fp8_kv_call_matches_torch(kv_dtype, dtype, heads, kv_heads, head_dim, page_size, spans, split_target,
                                          warps_in_flight):  # fmt: skip
    """Float8 pools: the Triton write rounds exactly as torch's cast (bit-equal pools), and the
    kernels' upcast reads give the torch backend's output; unsplit, decode rows take the vector
    kernel's wide tiles or (warps_in_flight 1, as at c >= 128) its one-warp tile (fp8_vector_tile)."""
    _need("triton", dtype)
    pools, rows, (q, k, v), mask = random_attention_call(
        heads, kv_heads, head_dim, page_size, spans, 0, True, num_pages=2000 // page_size + len(spans) + 2,
        depth_slots=4, dtype=dtype, device=CUDA, kv_dtype=kv_dtype,
    )
    ref = get_attention_backend("torch", CUDA, dtype, page_size, kv_dtype=kv_dtype)
    tri = get_attention_backend("triton", CUDA, dtype, page_size, kv_dtype=kv_dtype)
    tri.split_target, tri.fp8_warps_in_flight = split_target, warps_in_flight
    want = ref.forward(q, k, v, pools[0], 1, ref.prepare(rows, pools[0], mask), head_dim**-0.5)
    got = tri.forward(q, k, v, pools[1], 1, tri.prepare(rows, pools[1], mask), head_dim**-0.5)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    assert torch.equal(pools[0].raw_k, pools[1].raw_k) and torch.equal(pools[0].raw_v, pools[1].raw_v), "KV writes differ"


# -- whole engine, float32 greedy against the reference ---------------------------------------
SHAPES = {
    "ouro": {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 128},
    "nanbeige": {"num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 96},
}


def _workload(vocab: int, seed: str, n: int = 32, **params) -> list[dict]:
    rng = random.Random(seed)
    requests = []
    for i in range(n):
        r = {
            "id": f"r{i}",
            "prompt": [rng.randrange(3, vocab) for _ in range(rng.randint(1, 200))],
            "params": SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 10), ignore_eos=True, **params),
            "arrival": rng.randint(0, 60),
        }
        if rng.random() < 0.2:
            r["abort_at"] = r["arrival"] + rng.randint(0, 30)
        requests.append(r)
    return requests


def _engine(path: str, backend: str, dtype: str, page_size: int, chunk: int, budget: int, pages: int | None,
            kv_cache_dtype: str = "auto"):  # fmt: skip
    return LLMEngine(path, dtype=dtype, device="cuda", skip_tokenizer_init=True, attention_backend=backend,
                     page_size=page_size, long_prefill_token_threshold=chunk, max_num_batched_tokens=budget,
                     num_kv_pages=pages or 4096 // page_size, max_num_seqs=16, kv_cache_dtype=kv_cache_dtype)  # fmt: skip


FP8_CASES = [("torch", "ouro", "fp8", CONFIGS[0]), ("triton", "ouro", "fp8", CONFIGS[0]),
             ("triton", "ouro", "fp8_e5m2", CONFIGS[2]), ("triton", "nanbeige", "fp8", CONFIGS[1])]


@pytest.mark.parametrize(
    "backend,family,kv_cache_dtype,config",
    [(b, f, "auto", c) for b in ("torch", "triton") for f in ("ouro", "nanbeige") for c in CONFIGS] + FP8_CASES,
)
def test_engine_fp32_greedy_matches_reference(tmp_checkpoint, backend, family, kv_cache_dtype, config):
    """With float8 KV the reference rounds K/V the same way (ReferenceModel(kv_dtype=...))."""
    page_size, chunk, budget, pages = config
    _need(backend, torch.float32)
    path = tmp_checkpoint(family, seed=7, **SHAPES[family])
    ref = ReferenceModel.from_pretrained(path)
    if kv_cache_dtype != "auto":
        ref.kv_dtype = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}[kv_cache_dtype]
    requests = _workload(ref.config.vocab_size, f"{family}-{page_size}-{chunk}", logprobs=1)
    engine = _engine(path, backend, "float32", page_size, chunk, budget, pages, kv_cache_dtype)
    finished = _drive(engine, requests, random.Random(0))
    assert engine.num_free_pages == engine.num_pages, "pages leaked"
    compared = 0
    for r in requests:
        (out,) = finished[r["id"]]
        c = out.outputs[0]
        if c.finish_reason == "abort":
            continue
        want, logits = ref.greedy(r["prompt"], len(c.token_ids))
        assert c.token_ids == want, r["id"]
        lp = torch.log_softmax(logits.double(), -1)
        for i, (tok, table) in enumerate(zip(c.token_ids, c.logprobs)):
            assert abs(table[tok].logprob - lp[i, tok].item()) < 1e-3
        compared += 1
    assert compared >= 16


# -- whole engine, bf16 against the torch backend ---------------------------------------------
def _logprob_runs(path: str, backend: str, requests: list[dict], kv_cache_dtype: str = "auto") -> dict[str, tuple]:
    engine = _engine(path, backend, "bfloat16", 16, 64, 128, None, kv_cache_dtype)
    finished = _drive(engine, requests, random.Random(0))
    out = {}
    for r in requests:
        (o,) = finished[r["id"]]
        c = o.outputs[0]
        if c.finish_reason == "abort":
            continue
        prompt = [t[tok].logprob for t, tok in zip(o.prompt_logprobs[1:], r["prompt"][1:])]
        out[r["id"]] = (prompt, c.token_ids, [t[tok].logprob for t, tok in zip(c.logprobs, c.token_ids)])
    return out


@pytest.mark.parametrize(
    "backend,kv_cache_dtype", [("triton", "auto"), ("flash-attn", "auto"), ("triton", "fp8"), ("triton", "fp8_e5m2")]
)
@pytest.mark.parametrize("family", ["ouro", "nanbeige"])
def test_engine_bf16_logprobs_match_torch(tmp_checkpoint, backend, kv_cache_dtype, family):
    """float8 KV: the Triton path (qkv GEMV epilogue writing float8, CUDA graphs) against the torch
    backend's torch-cast K/V."""
    _need(backend, torch.bfloat16)
    path = tmp_checkpoint(family, seed=7, dtype="bfloat16", **SHAPES[family])
    requests = _workload(384, f"bf16-{family}", n=24, logprobs=1, prompt_logprobs=1)
    want = _logprob_runs(path, "torch", requests, kv_cache_dtype)
    got = _logprob_runs(path, backend, requests, kv_cache_dtype)
    assert want.keys() == got.keys() and len(want) >= 12
    for rid, (prompt, tokens, logprobs) in want.items():
        g_prompt, g_tokens, g_logprobs = got[rid]
        assert max((abs(a - b) for a, b in zip(prompt, g_prompt)), default=0.0) < 0.05, rid
        same = next((i for i, (a, b) in enumerate(zip(tokens, g_tokens)) if a != b), len(tokens))
        assert max((abs(a - b) for a, b in zip(logprobs[: same + 1], g_logprobs[: same + 1])), default=0.0) < 0.05


# -- CUDA graphs of decode steps ----------------------------------------------------------------
def _steady_decode(path: str, dtype: str, concurrency: int, params: dict | None = None,
                   **kw) -> tuple[dict[str, list[int]], LLMEngine]:  # fmt: skip
    engine = LLMEngine(path, dtype=dtype, device="cuda", skip_tokenizer_init=True, attention_backend="triton",
                       max_num_seqs=concurrency, num_kv_pages=2048, **kw)  # fmt: skip
    rng = random.Random(concurrency)
    for i in range(2 * concurrency):
        prompt = [rng.randrange(3, 300) for _ in range(rng.randint(1, 60))]
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=rng.randint(8, 24),
                                                           ignore_eos=True, logprobs=0, **(params or {})))  # fmt: skip
    out: dict[str, list] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                out[o.request_id] = (c.token_ids, [t[tok].logprob for t, tok in zip(c.logprobs, c.token_ids)])
    assert engine.num_free_pages == engine.num_pages
    return out, engine


@pytest.mark.parametrize(
    "family,concurrency,kv_cache_dtype",
    [(f, c, "auto") for f in ("ouro", "nanbeige", "huginn") for c in (1, 8, 32)] + [("ouro", 8, "fp8"), ("huginn", 8, "fp8")],
)
def test_cuda_graph_decode_matches_eager(tmp_checkpoint, family, concurrency, kv_cache_dtype):
    """Graph replays give the eager fused step's tokens and logprobs, and (over a workload with
    arrivals and finishes) at least 95% of decode steps replay a graph."""
    _need("triton", torch.float32)
    path = tmp_checkpoint(family, seed=7, **SHAPES.get(family, {}))
    graphed, engine = _steady_decode(path, "float32", concurrency, kv_cache_dtype=kv_cache_dtype)
    eager, _ = _steady_decode(path, "float32", concurrency, enforce_eager=True, kv_cache_dtype=kv_cache_dtype)
    st = engine.stats()
    assert engine.runner.graphs is not None
    assert st.num_cuda_graph_replays >= 0.95 * st.num_fused_decode_steps > 0
    assert graphed.keys() == eager.keys()
    for rid, (tokens, logprobs) in eager.items():
        assert graphed[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(graphed[rid][1], logprobs)) < 1e-4


@pytest.mark.parametrize("family,concurrency,kv_cache_dtype",
                         [("ouro", 1, "auto"), ("ouro", 8, "auto"), ("nanbeige", 8, "auto"), ("ouro", 8, "fp8")])
def test_attention_prefetch_gives_the_same_decode(tmp_checkpoint, monkeypatch, family, concurrency, kv_cache_dtype):
    """Graphed bf16 decode with the first key block read before the PDL wait (`prefetch_decode`)
    gives exactly the tokens and logprobs of decode without it: a read that raced the previous
    kernel's K/V write would show as a difference here."""
    _need("triton", torch.bfloat16)
    from rlt_serve.attention.triton_backend import TritonAttentionBackend

    monkeypatch.delenv("RLT_ATTN_PREFETCH", raising=False)

    path = tmp_checkpoint(family, seed=7, **SHAPES.get(family, {}))
    runs = {}
    for prefetch in (False, True):
        monkeypatch.setattr(TritonAttentionBackend, "prefetch_decode", prefetch)
        runs[prefetch], _ = _steady_decode(path, "bfloat16", concurrency, kv_cache_dtype=kv_cache_dtype)
    assert runs[True] == runs[False]


@pytest.mark.parametrize("family,mode", [
    ("ouro", dict(kv_layout="last_exited")), ("ouro", dict(kv_layout="last_exited", async_exit=True)),
    ("ouro", dict(kv_layout="last_exited", kv_cache_dtype="fp8")),
    ("ouro", dict(num_speculative_tokens=4, speculative_draft_depth=2)),
    ("ouro", dict(num_speculative_tokens=2, speculative_draft_depth=2, kv_cache_dtype="fp8")),
    ("nanbeige", dict(num_speculative_tokens=2, speculative_draft_depth=1)),
    ("huginn", dict(num_speculative_tokens=2, speculative_draft_depth=2)),
])  # fmt: skip
def test_loop_graphs_match_eager(tmp_checkpoint, family, mode):
    """One-loop graphs (early-exit rows, drafts) give the eager step's tokens and logprobs."""
    _need("triton", torch.float32)
    path = tmp_checkpoint(family, seed=7, **SHAPES.get(family, {}))
    exit_kw = dict(exit_threshold=0.6) if "kv_layout" in mode else {}
    graphed, engine = _steady_decode(path, "float32", 8, params=exit_kw, **mode)
    eager, _ = _steady_decode(path, "float32", 8, params=exit_kw, enforce_eager=True, **mode)
    assert engine.runner.loop_graphs is not None and engine.stats().num_loop_graph_replays > 0
    assert graphed.keys() == eager.keys()
    # Padded prompt calls change projection shapes, hence cuBLAS's kernels and the last bit of
    # K/V; float8 KV can turn that bit into one float8 step (1.01e-4 seen on an H100)
    tol = 1e-3 if mode.get("kv_cache_dtype") == "fp8" else 1e-4
    for rid, (tokens, logprobs) in eager.items():
        assert graphed[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(graphed[rid][1], logprobs)) < tol


def test_decode_step_host_syncs(tmp_checkpoint):
    """Steady-state decode: at most one host synchronisation per step (the sampled tokens)."""
    from rlt_serve.bench import count_decode_syncs

    path = tmp_checkpoint("ouro", seed=7, **SHAPES["ouro"])
    engine = LLMEngine(path, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, attention_backend="triton",
                       max_num_seqs=8, num_kv_pages=512)  # fmt: skip
    sites: dict[str, int] = {}
    syncs = count_decode_syncs(engine, 8, 300, sites=sites)
    # torch's own sync-debug bookkeeping reports one site per counting window; only the engine's count.
    ours = sum(n for site, n in sites.items() if "/rlt_serve/" in site)
    assert syncs is not None and ours <= 8, (syncs, sites)  # 8 steps were counted
    assert engine.num_free_pages == engine.num_pages


def test_fused_ops_bf16_match_torch():
    """The compiled fused kernels round where the torch ops do: RoPE bit-exact, norms within 2 bf16 ulps."""
    from types import SimpleNamespace

    from rlt_serve.models import fused_ops

    _need("triton", torch.bfloat16)
    g = torch.Generator(device="cuda").manual_seed(0)
    bf = dict(device="cuda", dtype=torch.bfloat16)
    x, res = torch.randn(300, 2048, generator=g, **bf), torch.randn(300, 2048, generator=g, **bf)
    pre, post = (SimpleNamespace(weight=torch.randn(2048, generator=g, **bf), eps=1e-6) for _ in range(2))
    h, y = fused_ops.add_rms_norm(x, res, pre, post)
    want_h = res + fused_ops.rms_norm_torch(x, pre.weight, pre.eps)
    want_y = fused_ops.rms_norm_torch(want_h, post.weight, post.eps)
    # The fp32 sum of squares is reduced in another order: a rounding boundary may move one ulp.
    # (With FP fusion on, 2 ulps were seen; with EXACT_ROUNDING, an H100 matched all 614,400 exactly.)
    for got, want in ((h, want_h), (y, want_y)):
        ulp = (want.float().abs() * 2**-7).clamp_min(2**-5)  # one ulp at magnitude 4 where sums cancel
        worst = ((got.float() - want.float()).abs() / ulp).max().item()
        assert worst <= 1.0, worst
    qkv = torch.randn(300, 3 * 16 * 128, generator=g, **bf)
    q, k, _ = qkv.split(16 * 128, dim=-1)
    q, k = q.view(300, 16, 128), k.view(300, 16, 128)
    cos, sin = torch.randn(300, 1, 128, generator=g, **bf), torch.randn(300, 1, 128, generator=g, **bf)
    want_q, want_k = fused_ops.rope_torch(q, cos, sin), fused_ops.rope_torch(k, cos, sin)
    got_q, got_k = fused_ops.rope(q, k, cos, sin)
    assert torch.equal(got_q, want_q), (got_q.float() - want_q.float()).abs().max()
    assert torch.equal(got_k, want_k)
    gu = torch.randn(300, 2 * 5632, generator=g, **bf)
    got, want = fused_ops.silu_mul(gu).float(), (torch.nn.functional.silu(gu[:, :5632]) * gu[:, 5632:]).float()
    assert ((got - want).abs() / (want.abs() * 2**-7).clamp_min(2**-126)).max().item() <= 1.0


# -- async scheduling -------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["ouro", "nanbeige", "huginn"])
def test_async_scheduling_graph_decode_matches_sync(tmp_checkpoint, family):
    """With graphs, the decode token taken from the previous step's device tensor (gathered into
    the graph's static input) gives the synchronous engine's tokens and logprobs: greedy steady
    decode, then the CPU test's randomised workload (seeded sampling, stops, preemption, aborts)."""
    from test_async_scheduling import _assert_same, _drive
    from test_async_scheduling import _workload as async_workload

    _need("triton", torch.float32)
    path = tmp_checkpoint(family, seed=7, **SHAPES.get(family, {}))
    pipelined, engine = _steady_decode(path, "float32", 8, async_scheduling=True)
    plain, _ = _steady_decode(path, "float32", 8)
    assert engine.runner.graphs is not None and engine.stats().num_cuda_graph_replays > 0
    assert engine.async_step.num_readbacks > 0 and engine.async_step.num_sync_steps == 0
    assert pipelined.keys() == plain.keys()
    for rid, (tokens, logprobs) in plain.items():
        assert pipelined[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(pipelined[rid][1], logprobs)) < 1e-4
    reqs = async_workload(7)
    kw = dict(device="cuda", attention_backend="triton", num_kv_pages=10, max_num_seqs=8, max_num_batched_tokens=24,
              long_prefill_token_threshold=8)  # fmt: skip
    got, e = _drive(path, True, reqs, **kw)
    want, _ = _drive(path, False, reqs, **kw)
    _assert_same(got, want, tol=1e-4)
    assert e.stats().num_cuda_graph_replays > 0


def test_async_decode_step_host_syncs(tmp_checkpoint):
    """Async scheduling, steady-state decode: one host wait per step (the previous step's tokens,
    read while this step runs) and no other synchronising call in the engine."""
    from rlt_serve.bench import count_decode_syncs

    path = tmp_checkpoint("ouro", seed=7, **SHAPES["ouro"])
    engine = LLMEngine(path, dtype="bfloat16", device="cuda", skip_tokenizer_init=True, attention_backend="triton",
                       max_num_seqs=8, num_kv_pages=512, async_scheduling=True)  # fmt: skip
    sites: dict[str, int] = {}
    syncs = count_decode_syncs(engine, 8, 300, sites=sites)
    ours = {site: n for site, n in sites.items() if "/rlt_serve/" in site}
    readback = [n for site, n in ours.items() if "InFlight.read" in site]
    assert readback == [8], (syncs, sites)  # 8 steps were counted: one readback each
    assert sum(ours.values()) <= 8, (syncs, sites)
    assert engine.num_free_pages == engine.num_pages
