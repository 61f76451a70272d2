"""The OpenAI API end to end: `rlt-serve launch` on CPU, the official `openai` client, real HTTP.

One server serves the module. Outputs are checked against the offline `LLM` on the same
checkpoint: same prompt, same sampling parameters and seed, same tokens.
"""

from __future__ import annotations

import asyncio
import glob
import json
import re

import httpx
import openai
import pytest
from test_router_support import REPO, Server, demo_checkpoint, launch

from rlt_serve import LLM, SamplingParams

PROMPTS = ["Once upon a time", "The capital of France is", "def add(a, b):"]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return demo_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(demo_model: str):
    with launch(demo_model) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(demo_model: str) -> LLM:
    return LLM(demo_model, device="cpu")


def _sp(**kw) -> SamplingParams:
    return SamplingParams(**kw)


def _idle(server: Server) -> bool:
    """Every credit returned, every page free, nothing running: what a finished request leaves."""
    m = server.metrics()
    pages = {k: v for k, v in m.items() if k.startswith("rlt:kv_cache_free_pages{")}
    total = {k: v for k, v in m.items() if k.startswith("rlt:kv_cache_total_pages{")}
    return (
        m['rlt:credits_reserved_pages{worker="0"}'] == 0
        and m['rlt:credits_reserved_slots{worker="0"}'] == 0
        and m["rlt:router_streams"] == 0
        and m['rlt:num_requests_running{worker="0"}'] == 0
        and list(pages.values()) == list(total.values())
    )


# -- completions and chat ----------------------------------------------------------------------


def test_models_and_health(server: Server, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["demo"]
    h = server.http.get("/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_completion_matches_offline_llm(client: openai.OpenAI, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    for temperature, seed in ((0.0, None), (0.8, 1234)):
        resp = client.completions.create(
            model="demo",
            prompt=PROMPTS,
            max_tokens=12,
            temperature=temperature,
            seed=seed,
            extra_body={"ignore_eos": True},
        )
        assert resp.object == "text_completion" and resp.model == "demo" and resp.id.startswith("cmpl-")
        outs = llm.generate(PROMPTS, _sp(max_tokens=12, temperature=temperature, seed=seed, ignore_eos=True))
        assert [c.index for c in resp.choices] == [0, 1, 2]
        for choice, out in zip(resp.choices, outs):
            ids = out.outputs[0].token_ids
            assert choice.text == tok.decode(ids)
            assert out.outputs[0].text == choice.text[: len(out.outputs[0].text)]
            assert choice.finish_reason == "length"
        prompt_tokens = sum(len(tok.encode(p)) for p in PROMPTS)
        assert resp.usage.prompt_tokens == prompt_tokens and resp.usage.completion_tokens == 36
        assert resp.usage.total_tokens == prompt_tokens + 36


def test_token_id_prompts(client: openai.OpenAI, llm: LLM) -> None:
    ids = llm.get_tokenizer().encode("Good morning")
    resp = client.completions.create(model="demo", prompt=ids, max_tokens=6, temperature=0)
    out = llm.generate({"prompt_token_ids": ids}, _sp(max_tokens=6, temperature=0))[0]
    assert resp.usage.prompt_tokens == len(ids)
    assert resp.choices[0].text == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    batch = client.completions.create(model="demo", prompt=[ids, ids[:2]], max_tokens=3, temperature=0)
    assert len(batch.choices) == 2 and batch.usage.prompt_tokens == len(ids) + 2


def test_chat_matches_offline_llm(client: openai.OpenAI, llm: LLM) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is the capital of France?"},
    ]
    resp = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=10, temperature=0.7, seed=5, extra_body={"ignore_eos": True}
    )
    out = llm.chat(messages, _sp(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True))[0]
    choice = resp.choices[0]
    assert resp.object == "chat.completion" and resp.id.startswith("chatcmpl-")
    assert choice.message.role == "assistant"
    assert choice.message.content == llm.get_tokenizer().decode(out.outputs[0].token_ids)
    assert resp.usage.prompt_tokens == len(out.prompt_token_ids) and resp.usage.completion_tokens == 10
    # chat_template_kwargs reach the template: the thinking prompt is longer.
    think = client.chat.completions.create(
        model="demo", messages=messages, max_tokens=1, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert think.usage.prompt_tokens > resp.usage.prompt_tokens
    # max_completion_tokens is the newer name of max_tokens.
    short = client.chat.completions.create(
        model="demo", messages=messages, max_completion_tokens=3, extra_body={"ignore_eos": True}
    )
    assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"


def test_streaming_completion_and_usage(client: openai.OpenAI, llm: LLM) -> None:
    kw = dict(model="demo", prompt=PROMPTS[0], max_tokens=15, temperature=0.9, seed=77, extra_body={"ignore_eos": True})
    full = client.completions.create(**kw)
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 15
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    body = [c for c in chunks[:-1]]
    assert all(c.usage is None and c.object == "text_completion" and c.id == chunks[0].id for c in body)
    assert "".join(c.choices[0].text for c in body) == full.choices[0].text
    assert body[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])


def test_streaming_chat(client: openai.OpenAI) -> None:
    kw = dict(
        model="demo", messages=[{"role": "user", "content": "Tell me a story."}], max_tokens=12, seed=3, temperature=1.0
    )
    full = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].object == "chat.completion.chunk"
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    plain = list(client.chat.completions.create(**kw, stream=True))
    assert all(getattr(c, "usage", None) is None for c in plain)


def test_n_and_seeds(client: openai.OpenAI, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    resp = client.completions.create(model="demo", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=1.0, seed=42)
    assert [c.index for c in resp.choices] == list(range(6))
    for p, prompt in enumerate(PROMPTS[:2]):
        for i in range(3):
            out = llm.generate(prompt, _sp(max_tokens=8, temperature=1.0, seed=42 + i))[0]
            assert resp.choices[p * 3 + i].text == tok.decode(out.outputs[0].token_ids)
    assert resp.usage.prompt_tokens == sum(len(tok.encode(p)) for p in PROMPTS[:2])
    again = client.completions.create(model="demo", prompt=PROMPTS[:2], n=3, max_tokens=8, temperature=1.0, seed=42)
    assert [c.text for c in again.choices] == [c.text for c in resp.choices]
    other = client.completions.create(model="demo", prompt=PROMPTS[0], n=1, max_tokens=8, temperature=1.0, seed=43)
    assert other.choices[0].text == resp.choices[1].text  # seed + i is choice i's seed
    # Streaming n > 1: every choice streams and finishes once.
    chunks = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=5, stream=True, seed=9,
        extra_body={"ignore_eos": True},
    ))  # fmt: skip
    texts = {0: "", 1: ""}
    done = []
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                done.append(ch.index)
    assert sorted(done) == [0, 1]


def test_stop_strings(client: openai.OpenAI, llm: LLM) -> None:
    kw = dict(
        model="demo", prompt="Good morning", max_tokens=30, temperature=1.0, seed=11, extra_body={"ignore_eos": True}
    )
    full = client.completions.create(**kw).choices[0].text
    stop = full[12:15]
    cut = full[: full.find(stop)]
    resp = client.completions.create(**kw, stop=[stop, "\x00never"])
    c = resp.choices[0]
    assert c.text == cut and c.finish_reason == "stop" and c.model_extra["stop_reason"] == stop
    offline = llm.generate("Good morning", _sp(max_tokens=30, temperature=1.0, seed=11, ignore_eos=True, stop=[stop]))[
        0
    ]
    assert offline.outputs[0].text == cut and resp.usage.completion_tokens == len(offline.outputs[0].token_ids)
    streamed = list(client.completions.create(**kw, stop=stop, stream=True))
    assert "".join(ch.choices[0].text for ch in streamed) == cut  # held-back text never leaks
    assert streamed[-1].choices[0].finish_reason == "stop"
    kw["extra_body"] = {"ignore_eos": True, "include_stop_str_in_output": True}
    kept = client.completions.create(**kw, stop=stop)
    assert kept.choices[0].text == cut + stop


def test_logprobs(client: openai.OpenAI, llm: LLM) -> None:
    resp = client.completions.create(model="demo", prompt=PROMPTS[1], max_tokens=6, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    out = llm.generate(PROMPTS[1], _sp(max_tokens=6, temperature=0, logprobs=3))[0].outputs[0]
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens == 6
    for i, (tok_id, table) in enumerate(zip(out.token_ids, out.logprobs)):
        assert lp.token_logprobs[i] == pytest.approx(table[tok_id].logprob, abs=1e-4)
        assert 3 <= len(lp.top_logprobs[i]) <= 4 and lp.top_logprobs[i][lp.tokens[i]] == pytest.approx(
            lp.token_logprobs[i]
        )
    assert lp.text_offset[0] == 0
    chat = client.chat.completions.create(
        model="demo",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=4,
        logprobs=True,
        top_logprobs=2,
        temperature=0,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].logprob >= entry.logprob  # greedy: the chosen one is the top one
    streamed = list(client.chat.completions.create(
        model="demo", messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True, top_logprobs=2,
        temperature=0, stream=True,
    ))  # fmt: skip
    got = [e.logprob for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert got == pytest.approx([e.logprob for e in content])


def test_tokenize_detokenize(server: Server, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    r = server.http.post("/tokenize", json={"prompt": "Hello world", "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode("Hello world") and r["count"] == len(r["tokens"]) and r["max_model_len"] == 2048
    assert len(r["token_strs"]) == r["count"]
    chat = server.http.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
    rendered = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(rendered, add_special_tokens=False)
    d = server.http.post("/detokenize", json={"tokens": r["tokens"]}).json()
    assert d == {"prompt": "Hello world"}


def test_loop_controls(client: openai.OpenAI) -> None:
    base = dict(model="demo", prompt="Hello", max_tokens=4, temperature=0)
    for loops in (1, 2, 4):
        resp = client.completions.create(**base, extra_body={"num_loops": loops, "ignore_eos": True})
        assert resp.usage.completion_tokens == 4
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(**base, extra_body={"num_loops": 64})  # beyond the engine's depth slots
    assert e.value.body["param"] == "num_loops"


# -- concurrency, disconnects, metrics ----------------------------------------------------------


def test_64_concurrent_streams(server: Server, llm: LLM) -> None:
    tok = llm.get_tokenizer()
    prompts = [f"The request number {i} is" for i in range(64)]

    async def run() -> list[tuple[str, int, int]]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=120)

        async def one(i: int) -> tuple[str, int, int]:
            stream = await aclient.completions.create(
                model="demo", prompt=prompts[i], max_tokens=12 + i % 5, temperature=1.0, seed=i, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            text, usage = "", None
            async for chunk in stream:
                if chunk.choices:
                    text += chunk.choices[0].text
                if chunk.usage is not None:
                    usage = chunk.usage
            return text, usage.prompt_tokens, usage.completion_tokens

        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await aclient.close()

    results = asyncio.run(run())
    for i, (_text, prompt_tokens, completion_tokens) in enumerate(results):
        assert prompt_tokens == len(tok.encode(prompts[i]))
        assert completion_tokens == 12 + i % 5
    for i in (0, 17, 63):  # spot-check against the offline engine
        out = llm.generate(prompts[i], _sp(max_tokens=12 + i % 5, temperature=1.0, seed=i, ignore_eos=True))[0]
        assert results[i][0] == tok.decode(out.outputs[0].token_ids)
    server.wait_for(lambda: _idle(server), what="all credits and pages returned")


def test_disconnect_mid_stream_frees_pages_and_credits(server: Server) -> None:
    aborted_before = server.metric("rlt:request_success_total", finished_reason="abort")
    body = {"model": "demo", "prompt": "Once", "max_tokens": 1500, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        with http.stream("POST", "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any(line.startswith("data: {") for line in got)
            m = server.metrics()
            assert m['rlt:credits_reserved_pages{worker="0"}'] == -(-(1 + 1500) // 16)
            assert m['rlt:credits_reserved_slots{worker="0"}'] == 1
    # Closed mid-stream: the worker request is aborted, its pages and credits come back.
    server.wait_for(lambda: _idle(server), what="pages and credits freed after the disconnect")
    server.wait_for(
        lambda: server.metric("rlt:request_success_total", finished_reason="abort") == aborted_before + 1,
        what="the worker to count the abort",
    )


def test_disconnect_while_waiting_for_a_json_response(server: Server) -> None:
    body = {"model": "demo", "prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(30, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    server.wait_for(lambda: _idle(server), what="pages and credits freed after a non-streaming disconnect")
    assert server.http.get("/health").status_code == 200


def test_dashboards_only_query_exported_metrics(server: Server, client: openai.OpenAI) -> None:
    client.completions.create(model="demo", prompt="Hi", max_tokens=3)
    list(client.completions.create(model="demo", prompt="Hi", max_tokens=3, stream=True))
    names = {k.split("{", 1)[0] for k in server.metrics()}
    files = sorted(glob.glob(str(REPO / "grafana" / "*.json")))
    assert len(files) >= 4
    used: set[str] = set()
    for path in files:
        dash = json.load(open(path))

        def walk(node) -> None:
            if isinstance(node, dict):
                for key, value in node.items():
                    if key in ("expr", "query", "definition") and isinstance(value, str):
                        used.update(re.findall(r"rlt:[A-Za-z0-9_:]+", value))
                    walk(value)
            elif isinstance(node, list):
                for item in node:
                    walk(item)

        walk(dash["panels"])
        walk(dash.get("templating", {}))
    assert used, "no PromQL found in the dashboards"
    missing = sorted(used - names)
    assert not missing, f"dashboards query metrics that /metrics does not export: {missing}"
