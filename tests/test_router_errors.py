"""Bad requests, auth and overload against a real server: the right 4xx in OpenAI's format.

The server runs with an API key, two request slots, a queue of one and a 64 KiB body limit,
so authentication, 413 and 429 can be provoked cheaply. After every bad request the server
must still serve a good one.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
from test_router_support import Server, demo_checkpoint, launch

KEY = "sekret"
AUTH = {"Authorization": f"Bearer {KEY}"}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return demo_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(demo_model: str):
    args = ("--api-key", KEY, "--max-num-seqs", "2", "--max-queue", "1", "--max-body-bytes", str(64 << 10))
    with launch(demo_model, *args) as s:
        yield s


def _ok(server: Server) -> None:
    r = server.http.post("/v1/completions", headers=AUTH, json={"model": "demo", "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def C(**kw) -> dict:
    return {"model": "demo", "prompt": "Hello", "max_tokens": 4, **kw}


def H(**kw) -> dict:
    return {"model": "demo", "messages": CHAT, "max_tokens": 4, **kw}


# (id, path, json body or raw bytes, expected status, expected param or None)
CASES = [
    ("invalid-json", "/v1/completions", b'{"prompt": "Hi", ', 400, None),
    ("body-not-object", "/v1/completions", b"[1, 2, 3]", 400, None),
    ("missing-prompt", "/v1/completions", {"model": "demo"}, 400, "prompt"),
    ("prompt-wrong-type", "/v1/completions", C(prompt=123), 400, "prompt"),
    ("empty-prompt", "/v1/completions", C(prompt=""), 400, "prompt"),
    ("empty-prompt-list", "/v1/completions", C(prompt=[]), 400, "prompt"),
    ("token-id-outside-vocab", "/v1/completions", C(prompt=[1, 999999]), 400, "prompt"),
    ("prompt-longer-than-context", "/v1/completions", C(prompt="hello " * 2100), 400, "prompt"),
    ("max-tokens-beyond-context", "/v1/completions", C(max_tokens=5000), 400, "max_tokens"),
    ("negative-max-tokens", "/v1/completions", C(max_tokens=-3), 400, "max_tokens"),
    ("zero-max-tokens", "/v1/completions", C(max_tokens=0), 400, "max_tokens"),
    ("max-tokens-string", "/v1/completions", C(max_tokens="5"), 400, "max_tokens"),
    ("unknown-model", "/v1/completions", C(model="gpt-17"), 404, "model"),
    ("negative-logprobs", "/v1/completions", C(logprobs=-1), 400, "logprobs"),
    ("too-many-logprobs", "/v1/completions", C(logprobs=50), 400, "logprobs"),
    ("negative-temperature", "/v1/completions", C(temperature=-0.5), 400, "temperature"),
    ("n-zero", "/v1/completions", C(n=0), 400, "n"),
    ("top-p-above-one", "/v1/completions", C(top_p=1.5), 400, "top_p"),
    ("top-k-below-minus-one", "/v1/completions", C(top_k=-5), 400, "top_k"),
    ("min-p-above-one", "/v1/completions", C(min_p=2.0), 400, "min_p"),
    ("min-tokens-above-max", "/v1/completions", C(min_tokens=10, max_tokens=4), 400, "min_tokens"),
    ("empty-stop-string", "/v1/completions", C(stop=[""]), 400, "stop"),
    ("stream-not-bool", "/v1/completions", C(stream="yes"), 400, "stream"),
    ("stream-options-without-stream", "/v1/completions", C(stream_options={"include_usage": True}), 400,
     "stream_options"),
    ("negative-seed", "/v1/completions", C(seed=-1), 400, "seed"),
    ("penalty-unsupported", "/v1/completions", C(presence_penalty=0.5), 400, "presence_penalty"),
    ("min-loops-above-num-loops", "/v1/completions", C(min_loops=3, num_loops=2), 400, "min_loops"),
    ("exit-threshold-above-one", "/v1/completions", C(exit_threshold=1.5), 400, "exit_threshold"),
    ("unknown-exit-criterion", "/v1/completions", C(exit_criterion="vibes"), 400, "exit_criterion"),
    ("num-loops-zero", "/v1/completions", C(num_loops=0), 400, "num_loops"),
    ("echo-unsupported", "/v1/completions", C(echo=True), 400, "echo"),
    ("chat-no-messages", "/v1/chat/completions", H(messages=[]), 400, "messages"),
    ("chat-message-without-role", "/v1/chat/completions", H(messages=[{"content": "hi"}]), 400, "messages.0.role"),
    ("chat-image-part", "/v1/chat/completions",
     H(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages.0.content"),
    ("chat-logprobs-not-bool", "/v1/chat/completions", H(logprobs="yes"), 400, "logprobs"),
    ("chat-top-logprobs-without-logprobs", "/v1/chat/completions", H(top_logprobs=2), 400, "top_logprobs"),
    ("chat-top-logprobs-too-many", "/v1/chat/completions", H(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("chat-negative-max-completion-tokens", "/v1/chat/completions", H(max_completion_tokens=-1), 400,
     "max_completion_tokens"),
    ("chat-unknown-model", "/v1/chat/completions", H(model="nope"), 404, "model"),
    ("chat-template-kwargs-not-object", "/v1/chat/completions", H(chat_template_kwargs=[1]), 400,
     "chat_template_kwargs"),
    ("oversize-body", "/v1/completions", C(prompt="x" * (70 << 10)), 413, None),
    ("detokenize-outside-vocab", "/detokenize", {"tokens": [-4]}, 400, "tokens"),
    ("tokenize-neither", "/tokenize", {}, 400, "prompt"),
]  # fmt: skip


@pytest.mark.parametrize("name,path,body,status,param", CASES, ids=[c[0] for c in CASES])
def test_bad_request(server: Server, name: str, path: str, body, status: int, param: str | None) -> None:
    if isinstance(body, bytes):
        r = server.http.post(path, content=body, headers={**AUTH, "Content-Type": "application/json"})
    else:
        r = server.http.post(path, json=body, headers=AUTH)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    _ok(server)


def test_the_table_is_big_enough() -> None:
    assert len(CASES) >= 20


def test_auth_and_routes(server: Server) -> None:
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = server.http.post("/v1/completions", json=C(), headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert server.http.get("/v1/models").status_code == 401
    assert server.http.get("/v1/models", headers=AUTH).status_code == 200
    assert server.http.get("/health").status_code == 200  # health and metrics stay open
    assert server.http.get("/metrics").status_code == 200
    r = server.http.get("/v1/completions", headers=AUTH)
    assert r.status_code == 405 and "error" in r.json()
    r = server.http.post("/v1/nothing", headers=AUTH, json={})
    assert r.status_code == 404 and "error" in r.json()
    # The official client maps the codes to its exception types.
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.completions.create(model="demo", prompt="Hi", max_tokens=1)
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY, max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="Hi", max_tokens=1)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="demo", messages=CHAT, temperature=-1)
    assert e.value.body["param"] == "temperature"
    _ok(server)


def test_overload_gets_429_and_priority_goes_first(server: Server) -> None:
    """Two slots busy, one queue place: the next request is refused; a higher priority evicts."""

    async def run() -> None:
        async with httpx.AsyncClient(base_url=server.base_url, headers=AUTH, timeout=60) as http:
            long = C(prompt="Once", max_tokens=1500, stream=True, ignore_eos=True)
            streams = [http.stream("POST", "/v1/completions", json=long) for _ in range(2)]
            opened = [await s.__aenter__() for s in streams]
            lines = [resp.aiter_lines() for resp in opened]  # referenced: collecting one closes its stream
            for resp, it in zip(opened, lines):
                assert resp.status_code == 200
                await it.__anext__()  # admitted and streaming
            queued = asyncio.create_task(http.post("/v1/completions", json=C(max_tokens=2)))
            await _until(lambda: server.metric("rlt:router_queue_length") == 1)
            refused = await http.post("/v1/completions", json=C(max_tokens=2))
            assert refused.status_code == 429, refused.text
            assert int(refused.headers["Retry-After"]) >= 1
            assert refused.json()["error"]["type"] == "rate_limit_error"
            urgent = asyncio.create_task(http.post("/v1/completions", json=C(max_tokens=2, priority=-1)))
            evicted = await queued  # the queue holds one: the lower priority one makes room
            assert evicted.status_code == 429
            for s in streams:
                await s.__aexit__(None, None, None)
            done = await urgent
            assert done.status_code == 200, done.text

    asyncio.run(run())
    server.wait_for(lambda: server.metric("rlt:credits_reserved_slots") == 0, what="credits returned")
    assert server.metric("rlt:router_requests_total", status="429") >= 2
    _ok(server)


async def _until(predicate, timeout: float = 20.0) -> None:
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not await asyncio.to_thread(predicate):
        if loop.time() > end:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.05)


def test_not_ready_is_503(demo_model: str, tmp_path) -> None:
    """Before any worker is Ready and warmed up: /health and generation say 503, nothing hangs."""
    from fastapi.testclient import TestClient

    from router.app import RouterConfig, WorkerSpec, create_app

    spec = WorkerSpec("ghost", "both", f"ipc://{tmp_path}/ghost")  # no process behind it
    app = create_app(RouterConfig(demo_model, "demo", f"ipc://{tmp_path}/router", [spec]))
    with TestClient(app) as http:
        h = http.get("/health")
        assert h.status_code == 503 and h.json()["status"] == "starting"
        assert h.json()["workers"]["ghost"]["status"] == "starting"
        r = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "no_worker"
        assert http.get("/v1/models").status_code == 200
        assert 'rlt:worker_up{worker="ghost"} 0.0' in http.get("/metrics").text
        app.state.pool.mark_dead("ghost", "gone")
        assert http.get("/health").json()["status"] == "unavailable"
