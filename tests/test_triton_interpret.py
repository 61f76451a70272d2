"""The Triton backend against the torch backend, run by Triton's CPU interpreter.

Float32 and tiny shapes only: the interpreter executes every program in numpy (slow), and its
bf16 `tl.dot` is broken. Triton reads TRITON_INTERPRET when it is first imported, so this module
sets it at collection, and only where no CUDA device exists (there nothing could run compiled
Triton anyway; on a GPU machine tests/test_gpu.py runs the compiled kernels instead). The backend
imports triton lazily, so no earlier test module has imported it in compiled mode.
"""

from __future__ import annotations

import random

import pytest
import torch
from triton_interpreter import select as select_interpreter

select_interpreter("tests/test_gpu.py")

# The interpreter reads loop bounds with int() of a one-element array, which numpy deprecates.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim:DeprecationWarning")

from rlt_serve.attention.backend import get_attention_backend
from rlt_serve.attention.torch_backend import TorchAttentionBackend
from rlt_serve.attention.triton_backend import TritonAttentionBackend, tile_shape
from rlt_serve.engine.llm_engine import LLMEngine
from rlt_serve.sampling_params import SamplingParams
from rlt_serve.testing import random_attention_call


def _random_call(heads, kv_heads, head_dim, page_size, spans, seed, masked):
    return random_attention_call(heads, kv_heads, head_dim, page_size, spans, seed, masked,
                                 num_pages=160 // page_size + 8)  # fmt: skip


# decode rows (1 token) and prompt spans (cached prefix + span) in one call
MIXED = [(1, 5), (7, 0), (1, 70), (20, 9), (3, 3), (1, 0)]
DECODE_ONLY = [(1, 5), (1, 90), (1, 0), (1, 33)]


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page_size,spans,masked",
    [
        (4, 4, 16, 1, MIXED, False),
        (4, 4, 16, 16, MIXED, True),
        (6, 2, 24, 16, MIXED, False),  # GQA group 3 (padded to 4), head_dim 24 (padded to 32)
        (8, 2, 32, 1, MIXED, True),
        (6, 1, 24, 1, DECODE_ONLY, False),  # decode-only call: the narrow tile
        (4, 4, 24, 16, DECODE_ONLY, True),  # decode-only without GQA: the vector kernel, head_dim padded
        (2, 2, 16, 1, DECODE_ONLY, False),
        (2, 2, 32, 16, [(80, 0), (1, 100)], False),  # a long span: several query tiles and key blocks
    ],
)
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split-kv"])
@pytest.mark.parametrize("decode_mha", [True, False], ids=["vector-decode", "tiled-only"])
def test_triton_matches_torch(heads, kv_heads, head_dim, page_size, spans, masked, splits, decode_mha):
    if not decode_mha and (heads != kv_heads or spans != DECODE_ONLY):
        pytest.skip("the vector kernel only serves one-query rows without GQA")
    (kv_ref, kv_tri), rows, (q, k, v), mask = _random_call(heads, kv_heads, head_dim, page_size, spans, 0, masked)
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend()
    tri.decode_mha = decode_mha
    tri.heads_first = splits == 1  # both grid orders of the vector kernel
    if splits > 1:  # force split-KV plus the combine: every program's keys cut into up to 3 ranges
        tri.split_target, tri.min_split_keys, tri.max_splits = 10**6, 16, splits
    scale = head_dim**-0.5
    want = ref.forward(q, k, v, kv_ref, 1, ref.prepare(rows, kv_ref, mask), scale)
    got = tri.forward(q, k, v, kv_tri, 1, tri.prepare(rows, kv_tri, mask), scale)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_tri.k, kv_ref.k) and torch.equal(kv_tri.v, kv_ref.v), "KV writes differ"


@pytest.mark.parametrize("heads,kv_heads,decode_mha", [(6, 2, False), (4, 4, False), (4, 4, True)],
                         ids=["tiled-gqa", "tiled", "vector"])  # fmt: skip
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split-kv"])
def test_decode_prefetch_gives_the_same_bits(monkeypatch, heads, kv_heads, decode_mha, splits):
    """Decode calls read their first key block before the PDL wait and the query's own key after
    it (`prefetch_decode`): the same output bits as loading the block in the loop."""
    monkeypatch.delenv("RLT_ATTN_PREFETCH", raising=False)
    (_, kv), rows, (q, k, v), mask = _random_call(heads, kv_heads, 24, 16, DECODE_ONLY + [(1, 15), (1, 16)], 1, True)
    out = {}
    for prefetch in (False, True):
        tri = TritonAttentionBackend()
        tri.decode_mha, tri.prefetch_decode = decode_mha, prefetch
        if splits > 1:
            tri.split_target, tri.min_split_keys, tri.max_splits = 10**6, 16, splits
        out[prefetch] = tri.forward(q, k, v, kv, 1, tri.prepare(rows, kv, mask), 24**-0.5)
    assert torch.equal(out[True], out[False])


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,page_size,spans",
    [
        # prompt tiles over several key blocks; (30, 14) and (9, 62) put a diagonal one key before a block end
        (4, 4, 16, 16, [(80, 0), (1, 40), (30, 14), (9, 62)]),
        (6, 2, 24, 1, MIXED),  # GQA, head_dim padded: unmasked blocks keep the head-dim mask
    ],
)
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split-kv"])
def test_prompt_tile_and_unmasked_blocks_match_torch(heads, kv_heads, head_dim, page_size, spans, splits):
    """The prompt tile (prefill_block_m with its own key step and warps) gives the torch backend's
    output; the loop over whole key blocks without masks gives the masked loop's exact bits."""
    (kv_ref, kv_tri), rows, (q, k, v), mask = _random_call(heads, kv_heads, head_dim, page_size, spans, 3, True)
    ref = TorchAttentionBackend()
    tris = [TritonAttentionBackend() for _ in range(3)]
    for tri in tris:  # float32 here, which the prompt tile otherwise leaves alone
        tri.prompt_rows = lambda dtype, tri=tri: tri.prefill_block_m
        tri.prefill_block_n, tri.prefill_warps, tri.prefill_stages = 16, 4, 2
    tris[0].prefill_full_first = False  # masked loop alone
    tris[2].prefill_block_m = 32  # another tile height
    for tri in tris:
        tri.split_target, tri.min_split_keys, tri.max_splits = (10**6, 16, splits) if splits > 1 else (1, 16, 1)
    for m in (32, 64):  # the prompt tile runs
        assert tile_shape(max(r.num_query for r in rows), heads // kv_heads, m)[0] == m
    scale = head_dim**-0.5
    want = ref.forward(q, k, v, kv_ref, 1, ref.prepare(rows, kv_ref, mask), scale)
    masked, unmasked, tall = (tri.forward(q, k, v, kv_tri, 1, tri.prepare(rows, kv_tri, mask), scale) for tri in tris)
    assert torch.equal(unmasked, masked)
    for got in (masked, tall):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_tri.k, kv_ref.k) and torch.equal(kv_tri.v, kv_ref.v), "KV writes differ"


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("heads,kv_heads,spans,decode_mha", [(6, 2, MIXED, False), (4, 4, DECODE_ONLY, True)])
@pytest.mark.parametrize("split,warps_in_flight", [(True, 2048), (False, 10**6), (False, 1)],
                         ids=["split-kv", "unsplit-wide", "unsplit-one-warp"])
def test_triton_matches_torch_fp8_kv(kv_dtype, heads, kv_heads, spans, decode_mha, split, warps_in_flight):
    """Float8 pools: the kernels' write rounds as torch's cast does, and their reads upcast alike
    (unsplit decode rows: the vector kernel's 4-warp, 128-key tile and its one-warp tile)."""
    (kv_ref, kv_tri), rows, (q, k, v), mask = _random_call(heads, kv_heads, 24, 16, spans, 1, True)
    (kv_ref, kv_tri), _, _, _ = random_attention_call(heads, kv_heads, 24, 16, spans, 1, True,
                                                      num_pages=160 // 16 + 8, kv_dtype=kv_dtype)  # fmt: skip
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend()
    tri.decode_mha, tri.fp8_warps_in_flight = decode_mha, warps_in_flight
    tri.split_target, tri.min_split_keys, tri.max_splits = 10**6 if split else 1, 16, 3
    want = ref.forward(q, k, v, kv_ref, 1, ref.prepare(rows, kv_ref, mask), 24**-0.5)
    got = tri.forward(q, k, v, kv_tri, 1, tri.prepare(rows, kv_tri, mask), 24**-0.5)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert torch.equal(kv_tri.raw_k, kv_ref.raw_k) and torch.equal(kv_tri.raw_v, kv_ref.raw_v), "KV writes differ"
    assert kv_tri.k.float().abs().sum() > 0


def test_fp8_vector_tile_keeps_warps_in_flight():
    """Unsplit float8 decode widens programs (32 keys a warp, up to 4 warps) while programs x warps
    stay within fp8_warps_in_flight; split key ranges keep one warp."""
    tri = TritonAttentionBackend()
    assert [tri.fp8_vector_tile(16 * c, 1) for c in (8, 32, 48, 64, 128, 256)] == [
        (128, 4, False), (128, 4, False), (64, 2, False), (64, 2, False), (32, 1, True), (32, 1, True)]
    assert tri.fp8_vector_tile(16, 9) == (32, 1, True)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [1, 3], ids=["whole", "split-kv"])
def test_fp8_bit_operands_match_torch(kv_dtype, splits):
    """A 16-bit q with float8 K/V: the tiled kernel moves K/V bits into fp16 operands (scaled back
    exactly), against the torch backend's upcast reads. Subnormal and saturated values included."""
    (kv_ref, kv_tri), rows, (q, k, v), mask = random_attention_call(6, 2, 24, 16, MIXED, 2, True, num_pages=18,
                                                                    kv_dtype=kv_dtype)  # fmt: skip
    for pool in (kv_ref, kv_tri):  # scale some values into float8's subnormal and saturating ranges
        pool.k[..., :3] = (pool.k[..., :3].float() * 1e-3).to(kv_dtype)
        pool.v[..., -2:] = (pool.v[..., -2:].float() * 300).to(kv_dtype)
    q, k, v = (x.half() for x in (q, k, v))
    ref, tri = TorchAttentionBackend(), TritonAttentionBackend()
    assert tri.kv_bits(kv_dtype, q.dtype) != 0
    tri.split_target, tri.min_split_keys, tri.max_splits = 10**6, 16, splits
    # The oracle: exact float32 attention over the stored values (fp16 k/v are exact in fp32).
    want = ref.forward(q.float(), k.float(), v.float(), kv_ref, 1, ref.prepare(rows, kv_ref, mask), 24**-0.5)
    got = tri.forward(q, k, v, kv_tri, 1, tri.prepare(rows, kv_tri, mask), 24**-0.5).float()
    err = (got - want).abs()
    # fp16 p and output: relative 2^-10 of the largest |v| a column can average (about 1 or 300 here).
    bound = 2e-3 * kv_ref.v.float().abs().amax(dim=(0, 1, 2, 3)) + 1e-3
    assert (err <= bound).all(), (err / bound).max()
    assert torch.equal(kv_tri.raw_k, kv_ref.raw_k) and torch.equal(kv_tri.raw_v, kv_ref.raw_v), "KV writes differ"


def test_auto_stays_torch_on_cpu_even_when_interpreting():
    assert get_attention_backend("auto", torch.device("cpu")).name == "torch"
    assert get_attention_backend("triton", torch.device("cpu")).name == "triton"


def _greedy(path: str, backend: str, loops: tuple = (4, 2, 3), **kw) -> dict[str, tuple[list[int], list[float]]]:
    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, attention_backend=backend,
                       page_size=4, long_prefill_token_threshold=5, max_num_batched_tokens=12, max_loops=4, **kw)  # fmt: skip
    rng = random.Random(1)
    for i, n in enumerate(loops):
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(1, 12))]
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=1,
                                                          num_loops=n))  # fmt: skip
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert engine.num_free_pages == engine.num_pages
    return {r: (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for r, c in done.items()}


def test_engine_greedy_triton_matches_torch(tmp_checkpoint):
    """Chunked prompts, mixed depths and decode through the whole engine, both backends."""
    path = tmp_checkpoint("ouro", seed=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    want, got = _greedy(path, "torch"), _greedy(path, "triton")
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < 1e-4


@pytest.mark.parametrize("family,kv_cache_dtype", [("ouro", "auto"), ("nanbeige", "auto"), ("ouro", "fp8")])
def test_engine_fused_projections_match_torch(tmp_checkpoint, monkeypatch, family, kv_cache_dtype):
    """The decode GEMV forced onto the CPU (RLT_GEMV=interpret), RoPE plus the K/V write in the
    qkv epilogue (on by default). Chunked prompts, mixed depths and decode equal the torch
    backend's, and the fused path actually ran."""
    from rlt_serve.models import gemv

    path = tmp_checkpoint(family, seed=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    loops = (4, 2, 3) if family == "ouro" else (None, None, None)  # Nanbeige runs a fixed depth
    want = _greedy(path, "torch", loops, kv_cache_dtype=kv_cache_dtype)
    calls = {"gemv": 0, "epilogue": 0, "kv": 0}
    launch = gemv.gemv

    def counting(x, w, silu=False, config=None, epilogue=None):
        calls["gemv"] += 1
        calls["epilogue"] += epilogue is not None
        calls["kv"] += epilogue is not None and epilogue.kv is not None
        return launch(x, w, silu, config, epilogue)

    monkeypatch.setattr(gemv, "gemv", counting)
    monkeypatch.setenv("RLT_GEMV", "interpret")
    got = _greedy(path, "triton", loops, kv_cache_dtype=kv_cache_dtype)
    assert min(calls.values()) > 0, calls
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < 1e-4


def _one_loop_rows(path: str, loop_rows: bool, **kw) -> tuple[dict, object]:
    """One-token rows at mixed depths: early exit (per-token depths, deeper slots filled; with
    async_exit an exited row runs one more loop whose writes are masked) and drafts stopping at
    depth 2. `loop_rows` runs their core calls through LoopGraphs' static buffers (uncaptured:
    the interpreter runs what a graph would replay)."""
    from rlt_serve.engine.loop_graph import LoopGraphs

    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, attention_backend="triton",
                       page_size=4, long_prefill_token_threshold=5, max_num_batched_tokens=16, max_num_seqs=4,
                       cuda_graph_sizes=[1, 2, 4], **kw)  # fmt: skip
    if loop_rows:
        engine.runner.loop_graphs = LoopGraphs(engine.runner, [1, 2], capture=False)
    rng = random.Random(2)
    for i in range(4):
        prompt = [rng.randrange(3, 384) for _ in range(rng.randint(2, 9))]
        exit_kw = dict(exit_threshold=0.5) if "kv_layout" in kw and i % 2 else {}
        engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=1,
                                                          **exit_kw))  # fmt: skip
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
    assert engine.num_free_pages == engine.num_pages
    out = {r: (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for r, c in done.items()}
    return out, engine.stats()


@pytest.mark.parametrize("mode", [dict(kv_layout="last_exited"), dict(kv_layout="last_exited", async_exit=True),
                                  dict(num_speculative_tokens=2, speculative_draft_depth=2)])  # fmt: skip
def test_one_loop_rows_through_static_buffers(tmp_checkpoint, mode):
    path = tmp_checkpoint("ouro", seed=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    want, _ = _one_loop_rows(path, False, **mode)
    got, st = _one_loop_rows(path, True, **mode)
    assert st.num_loop_graph_replays > 0
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < 1e-5


def _padded_prompts(path: str, graphs: bool, **kw) -> tuple[dict, object]:
    """Prompts of 1-17 tokens in chunks of up to 5 that climb depths together (wavefront), one
    to several rows a call, arriving at different steps. `graphs` runs their loops through
    LoopGraphs' padded prompt shapes (2, 4 or 6 tokens a row; uncaptured: the interpreter runs
    what a graph would replay)."""
    from rlt_serve.engine.loop_graph import LoopGraphs

    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, attention_backend="triton",
                       page_size=4, long_prefill_token_threshold=5, max_num_batched_tokens=24, max_num_seqs=4,
                       cuda_graph_sizes=[1, 2, 4], **kw)  # fmt: skip
    if graphs:
        engine.runner.loop_graphs = LoopGraphs(engine.runner, [], capture=False, prompt_tokens=[2, 4, 6])
    rng = random.Random(7)
    lengths = [17, 3, 1, 9, 12, 6]
    done, step = {}, 0
    while step < 2 * len(lengths) or engine.has_unfinished_requests():
        if step % 2 == 0 and step // 2 < len(lengths):
            i = step // 2
            prompt = [rng.randrange(3, 384) for _ in range(lengths[i])]
            exit_kw = dict(exit_threshold=0.5) if "kv_layout" in kw and i % 2 else {}
            engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True, logprobs=1,
                                                              **exit_kw))  # fmt: skip
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        step += 1
    assert engine.num_free_pages == engine.num_pages
    out = {r: (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for r, c in done.items()}
    return out, engine.stats()


@pytest.mark.parametrize("family,mode", [("ouro", {}), ("ouro", dict(kv_layout="last_exited")), ("huginn", {})])
def test_prompt_loops_through_padded_static_buffers(tmp_checkpoint, family, mode):
    """Prompt chunks padded to a captured token count (padding with no query and no K/V write,
    outputs dropped) give the eager tokens and logprobs, early-exit write masks included."""
    over = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16) if family == "ouro" else {}
    path = tmp_checkpoint(family, seed=8, **over)
    want, _ = _padded_prompts(path, False, **mode)
    got, st = _padded_prompts(path, True, **mode)
    assert 0 < st.num_loop_graph_replays < st.num_loop_calls  # wavefronts of > 4 rows run eagerly
    assert got.keys() == want.keys() and len(got) == 6
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < 1e-5


def _graph_decode(path: str, graphs: bool, async_scheduling: bool) -> tuple[dict, object]:
    """Requests arriving and finishing at different steps, so decode batches shrink and pad."""
    from rlt_serve.engine.cuda_graph import DecodeGraphs

    engine = LLMEngine(path, dtype="float32", device="cpu", skip_tokenizer_init=True, attention_backend="triton",
                       page_size=4, max_num_seqs=4, cuda_graph_sizes=[1, 2, 4],
                       async_scheduling=async_scheduling)  # fmt: skip
    if graphs:
        engine.runner.graphs = DecodeGraphs(engine.runner, engine.model_config.num_loops, capture=False)
    rng = random.Random(5)
    # Four decode together, then one finishes at a time: batches of 3, 2, 1 pad a graph whose
    # last rows held placeholders of earlier steps; a fifth arrives later and joins.
    reqs = [(0, 6), (0, 3), (0, 5), (0, 4), (4, 3)]
    done, step = {}, 0
    while step <= 4 or engine.has_unfinished_requests():
        for i, (arrive, n) in enumerate(reqs):
            if arrive == step:
                prompt = [rng.randrange(3, 384) for _ in range(rng.randint(2, 7))]
                engine.add_request(str(i), prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True,
                                                                  logprobs=1))  # fmt: skip
        done.update({o.request_id: o.outputs[0] for o in engine.step() if o.finished})
        step += 1
    assert engine.num_free_pages == engine.num_pages
    out = {r: (c.token_ids, [lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)]) for r, c in done.items()}
    return out, engine.stats()


def test_decode_graph_buffers_with_async_scheduling(tmp_checkpoint):
    """DecodeGraphs' static buffers (uncaptured), fed from the previous step's device tokens,
    give the eager synchronous tokens. Padding rows must never embed a stale placeholder."""
    path = tmp_checkpoint("ouro", seed=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    want, _ = _graph_decode(path, False, False)
    got, st = _graph_decode(path, True, True)
    assert st.num_cuda_graph_replays > 0
    assert got.keys() == want.keys()
    for rid, (tokens, logprobs) in want.items():
        assert got[rid][0] == tokens, rid
        assert max(abs(a - b) for a, b in zip(got[rid][1], logprobs)) < 1e-5


# -- fused elementwise ops of the decoder layer ---------------------------------------------------
def test_fused_ops_match_torch():
    from types import SimpleNamespace

    from rlt_serve.models import fused_ops

    g = torch.Generator().manual_seed(0)
    x, res = torch.randn(5, 40, generator=g), torch.randn(5, 40, generator=g)
    pre = SimpleNamespace(weight=torch.randn(40, generator=g), eps=1e-6)
    post = SimpleNamespace(weight=torch.randn(40, generator=g), eps=1e-5)
    for p, r, q in [(None, None, post), (pre, res, post), (None, res, post), (pre, res, None)]:
        h, y = fused_ops._add_norm_triton(x, r, p, q)
        t = fused_ops.rms_norm_torch(x, p.weight, p.eps) if p else x
        want_h = r + t if r is not None else x
        torch.testing.assert_close(h, want_h)
        if q is not None:
            torch.testing.assert_close(y, fused_ops.rms_norm_torch(want_h, q.weight, q.eps))
    # strided views of one fused projection: all heads in one program; blocks of 2 heads with
    # q's last block part-filled (3 heads); one head a program (too few tokens to fill programs)
    for q_heads, tile, min_programs in [(4, 1024, 1), (3, 16, 1), (4, 1024, 128)]:
        qkv = torch.randn(3, (q_heads + 2 + 2) * 16, generator=g)
        q, k, _ = qkv.split([q_heads * 16, 32, 32], dim=-1)
        q, k = q.view(3, q_heads, 16), k.view(3, 2, 16)
        cos, sin = torch.randn(3, 1, 16, generator=g), torch.randn(3, 1, 16, generator=g)
        want_q, want_k = fused_ops.rope_torch(q, cos, sin), fused_ops.rope_torch(k, cos, sin)
        want_v = qkv[:, -32:].clone()
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(fused_ops, "ROPE_TILE", tile)
            mp.setattr(fused_ops, "ROPE_MIN_PROGRAMS", min_programs)
            got_q, got_k = fused_ops._rope_triton(q, k, cos, sin)
        torch.testing.assert_close(got_q, want_q)
        torch.testing.assert_close(got_k, want_k)
        torch.testing.assert_close(qkv[:, -32:], want_v)  # v untouched
    gu = torch.randn(4, 2 * 24, generator=g)
    torch.testing.assert_close(fused_ops._silu_mul_triton(gu), torch.nn.functional.silu(gu[:, :24]) * gu[:, 24:])
