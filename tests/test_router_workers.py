"""A worker process dies under load: its requests fail fast and clearly, the router stays up.

Two workers serve; a stream is placed on each (admission picks the least loaded), then one
worker is SIGKILLed. Its stream must end with an error well within the deadline, /health and
/metrics must report the dead worker, its credits must come back, and the other worker keeps
serving. With the last worker gone, /health is 503 and a request gets a 503, not a hang.
"""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest
from test_router_support import Server, demo_checkpoint, launch


@pytest.fixture(scope="module")
def demo_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return demo_checkpoint(tmp_path_factory)


@pytest.fixture(scope="module")
def server(demo_model: str):
    # A slow model (2 ms a step): the long streams cannot finish before their worker is killed.
    with launch(demo_model, workers=2, env={"RLT_FAULT_INJECT": "step_delay=0.002"}) as s:
        yield s


def _pids(server: Server) -> dict[str, int]:
    return {wid: w["pid"] for wid, w in server.http.get("/health").json()["workers"].items()}


def test_killed_worker_fails_its_requests_and_is_reported(server: Server) -> None:
    client = openai.OpenAI(base_url=server.base_url + "/v1", api_key="x", max_retries=0, timeout=60)
    pids = _pids(server)
    assert sorted(pids) == ["0", "1"]
    long = dict(model="demo", prompt="Once", max_tokens=1900, stream=True, extra_body={"ignore_eos": True})
    doomed_stream = client.completions.create(**long)
    next(iter(doomed_stream))
    m = server.metrics()
    doomed = next(w for w in pids if m[f'rlt:credits_reserved_slots{{worker="{w}"}}'] == 1)
    other = "1" if doomed == "0" else "0"
    surviving_stream = client.completions.create(**long)  # the least loaded worker: the other one
    next(iter(surviving_stream))
    m = server.metrics()
    assert m[f'rlt:credits_reserved_slots{{worker="{other}"}}'] == 1

    os.kill(pids[doomed], signal.SIGKILL)
    t0 = time.monotonic()
    with pytest.raises(openai.APIError) as err:
        for _ in doomed_stream:
            pass
    assert time.monotonic() - t0 < 10
    assert f"worker {doomed}" in str(err.value.message)

    # The surviving stream is unaffected.
    text = "".join(c.choices[0].text for _, c in zip(range(20), surviving_stream))
    assert text
    surviving_stream.close()

    health = server.http.get("/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    assert health.json()["workers"][doomed]["status"] == "dead" and health.json()["workers"][doomed]["reason"]
    server.wait_for(
        lambda: server.metrics()[f'rlt:credits_reserved_slots{{worker="{other}"}}'] == 0, what="credits back"
    )
    m = server.metrics()
    assert m[f'rlt:worker_up{{worker="{doomed}"}}'] == 0 and m[f'rlt:worker_up{{worker="{other}"}}'] == 1
    assert m[f'rlt:credits_reserved_pages{{worker="{doomed}"}}'] == 0
    assert m[f'rlt:credits_reserved_slots{{worker="{doomed}"}}'] == 0

    # New work goes to the live worker.
    resp = client.completions.create(model="demo", prompt="Hi", max_tokens=3)
    assert resp.usage.completion_tokens >= 1

    # The last worker dies with a non-streaming request in flight: a clear 503, then /health 503.
    status: dict[str, int | str] = {}

    def post() -> None:
        body = {"prompt": "Once", "max_tokens": 1900, "ignore_eos": True}
        r = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        status["code"], status["body"] = r.status_code, r.text

    t = threading.Thread(target=post)
    t.start()
    server.wait_for(lambda: server.metrics()[f'rlt:credits_reserved_slots{{worker="{other}"}}'] == 1, what="admitted")
    os.kill(pids[other], signal.SIGKILL)
    t.join(15)
    assert not t.is_alive()
    assert status["code"] == 503 and f"worker {other}" in str(status["body"])
    assert server.http.get("/health").status_code == 503
    r = server.http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 503 and r.json()["error"]["message"]
    assert server.http.get("/metrics").status_code == 200
