"""Prefill/decode disaggregation over real processes equals one `both` worker, token for token.

For each family (Ouro, Nanbeige4.2, Huginn; tiny random checkpoints) a batch of 64 mixed requests
(shared prefixes, greedy and seeded sampling, some stopping at EOS) runs on a single `both` worker,
then on 1 prefill + 1 decode worker over NIXL (UCX on host memory, loopback) with prefix caching
on and off, then on 2 + 2: a second prefill and a second decode worker join the running router with
`rlt-serve worker --router tcp://...`, as pods of a deployment would. Text, finish reasons and
logprobs must be equal, the joined workers must have served part of the batch, and afterwards every
credit, page, state slot, reservation and transfer handle is back. Ouro also runs 1 + 1 over the
ZMQ transport.
"""

from __future__ import annotations

import signal
import subprocess

import pytest
from pd_support import ENGINE, assert_same, join_worker, launch, make_checkpoint, run_workload, vocab_of, workload

FAMILIES = ("ouro", "nanbeige", "huginn")
N_REQUESTS = 64


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory):
    return tmp_path_factory.mktemp("pd-models")


def _both(model: str, reqs: list[dict]) -> list[tuple]:
    with launch(model, "--workers", "1", *ENGINE, "--no-enable-prefix-caching") as s:
        out = run_workload(s, reqs)
        s.assert_idle()
        return out


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(20)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def _check_incompatible_worker_refused(s, model: str) -> None:
    """A worker whose KV layout cannot match its peers' (another page size) is refused, saying why."""
    w = join_worker(model, "decode", s.worker_endpoint, "d-odd", "--kv-transport", "nixl", "--page-size", "8",
                    stderr=subprocess.PIPE)  # fmt: skip
    _, err = w.communicate(timeout=120)
    assert w.returncode == 0 and "refused it" in err.decode() and "KV layout" in err.decode(), err[-2000:]
    assert s.workers()["d-odd"]["status"] == "dead" and "page size" in s.workers()["d-odd"]["reason"]
    assert s.http.post("/v1/completions", json={"model": "m", "prompt": [5, 6, 7], "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize("family", FAMILIES)
def test_pd_equals_both_worker(root, family: str) -> None:
    model = make_checkpoint(root, family)
    reqs = workload(N_REQUESTS, vocab_of(model), seed=len(family))
    want = _both(model, reqs)
    for caching in ("--enable-prefix-caching", "--no-enable-prefix-caching"):
        pd = ("--prefill", "1", "--decode", "1", "--kv-transport", "nixl", "--worker-port", "0")
        with launch(model, *pd, *ENGINE, caching) as s:
            assert_same(run_workload(s, reqs), want, f"{family} 1P1D nixl {caching}")
            m = s.metrics()
            assert m['rlt:kv_transfer_bytes_total{direction="sent",worker="p0"}'] > 0
            assert m.get('rlt:kv_transfer_failures_total{reason="stale",worker="d0"}', 0) == 0
            s.assert_idle()
            assert s.worker_endpoint and s.worker_endpoint.startswith("tcp://127.0.0.1:")
            joined = [join_worker(model, role, s.worker_endpoint, f"{role}-joined", "--kv-transport", "nixl", caching)
                      for role in ("prefill", "decode")]  # fmt: skip
            try:
                ids = ("prefill-joined", "decode-joined")
                s.wait_for(lambda: all(s.workers().get(w, {}).get("status") == "ready" for w in ids), 120,
                           "joined workers warmed up")  # fmt: skip
                assert all(s.workers()[w].get("joined") for w in ids)
                assert_same(run_workload(s, reqs), want, f"{family} 2P2D nixl {caching}")
                # Every worker served part of the batch (workers report metrics once a second).
                keys = [f'rlt:prompt_tokens_total{{worker="{w}"}}' for w in ("p0", "prefill-joined")]
                keys += [f'rlt:{n}{{{lab}worker="{w}"}}' for w in ("d0", "decode-joined")
                         for n, lab in (("generation_tokens_total", ""),
                                        ("kv_transfer_chunks_total", 'direction="received",'))]  # fmt: skip
                s.wait_for(lambda: all(s.metrics().get(k, 0) > 0 for k in keys), 10, f"work on every worker: {keys}")
                s.assert_idle()
            finally:
                _stop(joined)
            # The joined workers left: the router notices, and the launched pair still serves.
            s.wait_for(lambda: all(s.workers()[w]["status"] == "dead" for w in ids), 30, "joined workers gone")
            assert_same(run_workload(s, reqs[:8]), want[:8], f"{family} after the joined workers left")
            s.assert_idle()
            if family == "ouro" and caching == "--enable-prefix-caching":
                _check_incompatible_worker_refused(s, model)
    if family == "ouro":
        with launch(model, "--prefill", "1", "--decode", "1", "--kv-transport", "zmq", *ENGINE) as s:
            assert_same(run_workload(s, reqs), want, "ouro 1P1D zmq")
            assert s.metrics()['rlt:kv_transfer_bytes_total{direction="sent",worker="p0"}'] > 0
            s.assert_idle()
