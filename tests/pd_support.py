"""Real PD servers for the PD tests: `rlt-serve launch` subprocesses on CPU, tiny checkpoints.

Not a test module: tests/test_pd_serving.py and tests/test_pd_faults.py import from here. Every
wait polls a condition with a timeout; nothing sleeps for a fixed time and hopes.
"""

from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import test_router_support as router_support

REPO = router_support.REPO
_JOIN = re.compile(r"workers join at: (tcp://\S+)")

# Small pages and chunks: every prompt spans several pages and several prefill chunks, so KV
# moves in several writes per request while later chunks compute.
ENGINE = ["--page-size", "4", "--num-kv-pages", "160", "--max-num-seqs", "8", "--max-num-batched-tokens", "32",
          "--long-prefill-token-threshold", "8", "--swap-space-bytes", "0"]  # fmt: skip


def make_checkpoint(root: Path, family: str) -> str:
    """A tiny random checkpoint of `family` with the demo tokenizer (the router tokenises)."""
    from rlt_serve.demo import build_demo_tokenizer
    from rlt_serve.testing import write_random_checkpoint
    from rlt_serve.tokenizer import Tokenizer

    path = str(root / family)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    build_demo_tokenizer(path)
    vocab = Tokenizer.from_pretrained(path).vocab_size
    extra: dict = {"max_position_embeddings": 512} if family != "huginn" else {"block_size": 512}
    write_random_checkpoint(path, family, seed=5, vocab_size=vocab, generation_config={"eos_token_id": 0}, **extra)
    return path


class Server(router_support.Server):
    """A PD server: also the workers' join endpoint, their /health records and idleness checks."""

    wait_timeout, poll_s, log_tail = 30.0, 0.05, 40

    def __init__(self, proc: subprocess.Popen, base_url: str, log: list[str]) -> None:
        super().__init__(proc, base_url, log)
        m = next((_JOIN.search(line) for line in log if _JOIN.search(line)), None)
        self.worker_endpoint = m.group(1) if m else None

    def idle(self) -> bool:
        return not self.busy()

    def busy(self) -> list[str]:
        """What is still held: credits, tickets, streams, handoffs, a live worker's pages or slots."""
        m = self.metrics()
        router = ("rlt:router_tickets", "rlt:router_streams", "rlt:router_queue_length")
        held = [f"{k}={m[k]:g}" for k in router if m.get(k, 0)]
        held += [f"{k}={v:g}" for k, v in m.items()
                 if v and k.startswith(("rlt:pd_requests{", "rlt:credits_reserved_", "rlt:role_credits_reserved_"))]  # fmt: skip
        for wid, w in self.workers().items():
            if w["status"] == "dead":
                continue
            if "free_pages" not in w:
                held.append(f"{wid}: no capacity report")
                continue
            for k in ("running", "waiting", "reservations", "transfers"):
                if w.get(k):
                    held.append(f"{wid}: {k}={w[k]}")
            if w["free_pages"] != w["total_pages"] or w["free_slots"] != w["total_slots"]:
                held.append(f"{wid}: pages {w['free_pages']}/{w['total_pages']} slots {w['free_slots']}/{w['total_slots']}")
        return held

    def assert_idle(self, timeout: float = 20.0) -> None:
        """Wait for `idle`, then check the workers' own gauges agree (state slots, held, in flight)."""
        try:
            self.wait_for(self.idle, timeout, "every pool, credit and registration back to its initial count")
        except AssertionError as e:
            raise AssertionError(f"still held: {self.busy()}\n{e}") from None
        regs = {w["registrations"] for w in self.workers().values() if w["status"] != "dead" and w["role"] != "both"}
        assert regs <= {3}, regs  # K, V and the final-state buffer, registered once each

        def gauges_idle() -> bool:
            m = self.metrics()
            return all(
                v == 0 for k, v in m.items()
                if k.startswith(("rlt:pd_requests_held", "rlt:kv_transfer_in_flight_", "rlt:num_requests_"))
            )  # fmt: skip

        self.wait_for(gauges_idle, timeout, "worker gauges idle")

    def pid(self, worker_id: str) -> int:
        return int(self.workers()[worker_id]["pid"])


@contextmanager
def launch(model: str, *args: str, ready_timeout: float = 120.0, env: dict | None = None) -> Iterator[Server]:
    """`rlt-serve launch --model MODEL ARGS...` until every worker is warm; SIGTERM (then SIGKILL) after."""
    cmd = [sys.executable, "-m", "rlt_serve.cli", "launch", "--model", model, "--served-model-name", "m",
           "--device", "cpu", "--port", "0", *args]  # fmt: skip
    with router_support.serve(cmd, Server, ready_timeout, ready_marker="health:",
                              env={**os.environ, "UCX_NET_DEVICES": "lo", **(env or {})}) as server:  # fmt: skip
        # /health is 200 once one worker of each role is warm; the others' warm-up handoffs
        # would still hold credits while the first test counts them.
        server.wait_all_warm(ready_timeout)
        yield server


stop = router_support.stop


def join_worker(model: str, role: str, endpoint: str, worker_id: str, *args: str, stderr=None) -> subprocess.Popen:
    """`rlt-serve worker --role ROLE --router ENDPOINT`: a worker joining a running router."""
    cmd = [sys.executable, "-m", "rlt_serve.cli", "worker", "--role", role, "--router", endpoint, "--model", model,
           "--worker-id", worker_id, "--device", "cpu", "--listen", "tcp://127.0.0.1:0", *ENGINE, *args]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "UCX_NET_DEVICES": "lo"}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=stderr, start_new_session=True)


# -- the workload --------------------------------------------------------------------------------


def workload(n: int, vocab: int, seed: int = 0) -> list[dict]:
    """Mixed requests: shared system prefixes (prefix-cache hits on both sides), lengths across
    page and chunk boundaries, greedy and seeded sampling, some stopping at EOS. Every request
    has a seed (Huginn's initial state depends on it even when greedy)."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(rng.choice((9, 16, 23)))] for _ in range(3)]
    reqs = []
    for i in range(n):
        tail = [rng.randrange(3, vocab) for _ in range(rng.randint(1, 21))]
        prompt = systems[i % 3] + tail if i % 4 else tail
        body = {"model": "m", "prompt": prompt, "max_tokens": rng.randint(1, 12), "seed": 1000 + i, "logprobs": 1,
                "ignore_eos": i % 5 != 0}  # fmt: skip
        if i % 2:
            body.update(temperature=0.9, top_p=0.95)
        else:
            body.update(temperature=0.0)
        reqs.append(body)
    return reqs


def run_workload(server: Server, reqs: list[dict], concurrency: int = 12) -> list[tuple]:
    """(text, finish_reason, token logprobs) per request, in request order."""

    def one(body: dict) -> tuple:
        r = server.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        return c["text"], c["finish_reason"], c["logprobs"]["token_logprobs"]

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(one, reqs))


def assert_same(got: list[tuple], want: list[tuple], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g[:2] == w[:2], f"{what}: request {i}: {g[:2]} != {w[:2]}"
        assert len(g[2]) == len(w[2]) and all(abs(a - b) < 1e-4 for a, b in zip(g[2], w[2])), (what, i, g[2], w[2])


def vocab_of(model: str) -> int:
    with open(os.path.join(model, "config.json")) as f:
        return json.load(f)["vocab_size"]
