"""KV transfer between two real processes, over NIXL (UCX, host memory) and over ZMQ.

The receiver runs in a spawned process and refuses writes whose generation is stale; the writer
moves pages of every plane plus a final-state row, waits for completion, gets the receiver's ack
(release) or `refused`, and a write to a killed peer fails within its timeout.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import time

import pytest
import torch

from workers.transfer import (
    KVLayout,
    TransferNotif,
    decode_notif,
    encode_notif,
    kv_regions,
    make_agent,
    state_regions,
)
from workers.transfer.nixl_agent import nixl_unavailable

SHAPE_A = (3, 10, 4, 2, 8)  # planes, pages, page_size, kv_heads, head_dim
SHAPE_B = (3, 12, 4, 2, 8)  # the receiver's pool is a different size: offsets must use its layout
LIVE = ("r1", 7)  # the receiver's only live (request, generation)


def _transports():
    why = nixl_unavailable()
    return ["zmq", pytest.param("nixl", marks=pytest.mark.skipif(why is not None, reason=why or ""))]


@pytest.fixture(autouse=True)
def _loopback(monkeypatch):
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")  # spawned receivers inherit it


def _buffers(shape, fill: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    make = (lambda *s: torch.randn(*s, generator=g)) if fill else torch.zeros
    return [make(*shape), make(*shape), make(4, 16)]


def _receiver(kind: str, conn) -> None:
    """Receive until the writer says it is finished, acking each accepted chunk (release); report
    what arrived, close, report the counts, then idle until killed (the dead peer)."""
    torch.set_num_threads(1)
    bufs = _buffers(SHAPE_B, fill=False)
    agent = make_agent(kind, "dec", bufs, accept=lambda peer, n: (n.request_id, n.generation) == LIVE)
    conn.send(agent.metadata())
    agent.add_peer("pre", conn.recv())
    got, deadline = [], time.monotonic() + 60
    while time.monotonic() < deadline:
        for peer, msg in agent.notifications():
            n = decode_notif(msg)
            got.append((peer, n))
            if n.kind == "chunk":
                agent.notify(peer, encode_notif(TransferNotif("ack", n.request_id, n.generation, n.chunk)))
            if n.kind == "finished":
                deadline = 0
        time.sleep(0.002)
    refused, arrays = agent.num_refused, [b.numpy().copy() for b in bufs]
    # A second agent stays open for the dead-peer phase; the first one closes.
    spare = make_agent(kind, "dec2", _buffers(SHAPE_B, fill=False))
    conn.send(spare.metadata())
    agent.close()
    conn.send((got, refused, arrays, (agent.num_registered, agent.num_peers, agent.num_handles)))
    time.sleep(60)


def _recv(conn, timeout: float = 60.0):
    """The receiver's next message; fails instead of hanging if it died."""
    assert conn.poll(timeout), "the receiver process did not answer"
    return conn.recv()


def _wait(agent, handles: list[int], timeout: float = 30.0, heard: list | None = None) -> list[str]:
    """Poll until every handle completed; notifications that arrive meanwhile go to `heard`."""
    deadline = time.monotonic() + timeout
    while any(agent.status(h) == "pending" for h in handles):
        assert time.monotonic() < deadline, "transfer never completed"
        got = agent.notifications()
        if heard is not None:
            heard += [(p, decode_notif(m)) for p, m in got]
        time.sleep(0.002)
    return [agent.status(h) for h in handles]


@pytest.mark.parametrize("kind", _transports())
def test_two_processes(kind):
    """Pages of every plane and a state row land and are verified; the receiver acks the live
    chunk and refuses the stale one; registrations go back to zero; then the receiver is killed
    and a write to it fails within its timeout."""
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(kind, child), daemon=True)
    proc.start()
    bufs = _buffers(SHAPE_A, fill=True)
    agent = make_agent(kind, "pre", bufs, timeout_s=60.0)  # a loaded CI box must not time these out
    try:
        agent.add_peer("dec", _recv(conn))
        conn.send(agent.metadata())
        la, lb = KVLayout.of(bufs[0], bufs[2]), KVLayout.of(torch.empty(SHAPE_B), torch.empty(4, 16))
        src_pages, dst_pages = [1, 2, 3, 8], [5, 6, 7, 0]
        src, dst = kv_regions(la, lb, src_pages, dst_pages)
        assert len(src) == 2 * 3 * 2  # K and V, 3 planes, 2 runs of consecutive pages
        s_src, s_dst = state_regions(la, lb, 2, 3)
        good = agent.write("dec", src + s_src, dst + s_dst, encode_notif(TransferNotif("chunk", *LIVE, 0, True)))
        stale = agent.write("dec", *kv_regions(la, lb, [4], [9]), encode_notif(TransferNotif("chunk", "r1", 6, 1)))
        heard: list = []
        states = _wait(agent, [good, stale], heard=heard)
        assert states[0] == "done"
        assert states[1] == ("failed" if kind == "zmq" else "done")  # NIXL puts are one-sided
        deadline = time.monotonic() + 30
        while len(heard) < 2:
            assert time.monotonic() < deadline, f"no ack/refusal, heard {heard}"
            heard += [(p, decode_notif(m)) for p, m in agent.notifications()]
            time.sleep(0.002)
        assert sorted((p, n.kind, n.generation, n.chunk) for p, n in heard) == [
            ("dec", "ack", 7, 0), ("dec", "refused", 6, 1)]
        assert agent.bytes_written == sum(r.nbytes for r in src + s_src) + (0 if kind == "zmq" else 2 * 3 * 256)
        agent.release(good)
        agent.release(stale)
        agent.notify("dec", encode_notif(TransferNotif("finished", "", 0)))
        agent.add_peer("dec2", _recv(conn))
        got, refused, arrays, counts = _recv(conn)
        k, v, state = (torch.from_numpy(a) for a in arrays)

        # the dead peer
        os.kill(proc.pid, 9)
        proc.join(10)
        t0 = time.monotonic()
        h = agent.write("dec2", *kv_regions(la, lb, [0, 1], [2, 3]), encode_notif(TransferNotif("chunk", *LIVE)),
                        timeout_s=2.0)
        assert _wait(agent, [h], timeout=10) == ["failed"]
        assert time.monotonic() - t0 < 5
        agent.release(h)
        agent.remove_peer("dec2")
        st = agent.stats()
        assert (st.writes_posted, st.writes_done, st.writes_failed) == ((3, 1, 2) if kind == "zmq" else (3, 2, 1))
        assert st.inflight_bytes == 0 and st.bytes_written == agent.bytes_written and st.write_seconds > 0
    finally:
        agent.close()
        if proc.is_alive():
            os.kill(proc.pid, 9)
        proc.join(10)
    assert [(p, n.kind, n.request_id, n.generation, n.last) for p, n in got] == [
        ("pre", "chunk", "r1", 7, True), ("pre", "finished", "", 0, False)]
    assert refused == 1
    assert torch.equal(k[:, dst_pages], bufs[0][:, src_pages]) and torch.equal(v[:, dst_pages], bufs[1][:, src_pages])
    assert torch.equal(state[3], bufs[2][2])
    untouched = [p for p in range(SHAPE_B[1]) if p not in dst_pages + [9]]
    assert not k[:, untouched].any() and not v[:, untouched].any()
    if kind == "zmq":  # the refused write never landed
        assert not k[:, 9].any()
    assert counts == (0, 0, 0)
    assert (agent.num_registered, agent.num_peers, agent.num_handles) == (0, 0, 0)


def test_regions_merge_runs_and_check_layouts():
    la, lb = KVLayout(2, 10, 64, 16), KVLayout(2, 20, 64, 16)
    src, dst = kv_regions(la, lb, [3, 4, 5, 9], [0, 1, 7, 8], planes=[1])
    assert [(r.buf, r.offset, r.nbytes) for r in src] == [(0, (10 + 3) * 64, 128), (0, (10 + 5) * 64, 64),
                                                          (0, (10 + 9) * 64, 64), (1, (10 + 3) * 64, 128),
                                                          (1, (10 + 5) * 64, 64), (1, (10 + 9) * 64, 64)]
    assert [(r.buf, r.offset, r.nbytes) for r in dst] == [(0, (20 + 0) * 64, 128), (0, (20 + 7) * 64, 64),
                                                          (0, (20 + 8) * 64, 64), (1, (20 + 0) * 64, 128),
                                                          (1, (20 + 7) * 64, 64), (1, (20 + 8) * 64, 64)]
    with pytest.raises(ValueError, match="incompatible"):
        kv_regions(la, KVLayout(2, 10, 32, 16), [0], [0])
    e4m3 = KVLayout.of(torch.zeros(2, 10, 4, 2, 8, dtype=torch.float8_e4m3fn))
    e5m2 = KVLayout.of(torch.zeros(2, 10, 4, 2, 8, dtype=torch.float8_e5m2))
    assert e4m3.page_bytes == e5m2.page_bytes
    with pytest.raises(ValueError, match="kv_cache_dtype"):  # same bytes, different numbers
        kv_regions(e4m3, e5m2, [0], [0])
    with pytest.raises(ValueError, match="out of range"):
        kv_regions(la, lb, [10], [0])
    with pytest.raises(ValueError, match="--kv-transport"):
        make_agent("tcp", "x", [])


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("kind", _transports())
def test_engine_handoff_over_transport(kind, device, kv_cache_dtype, tmp_checkpoint):
    """Two engines joined by real agents: chunks pushed as reported, committed on notification,
    released on ack; outputs equal one engine and every page, slot and handle comes back. On a GPU
    the agents register device memory (NIXL VRAM)."""
    from rlt_serve.engine.llm_engine import LLMEngine
    from rlt_serve.sampling_params import SamplingParams
    from workers.transfer import chunk_regions

    path = tmp_checkpoint("ouro", seed=3)
    kw = dict(dtype="float32", device=device, skip_tokenizer_init=True, page_size=4, num_kv_pages=96,
              max_num_batched_tokens=16, long_prefill_token_threshold=6, kv_cache_dtype=kv_cache_dtype)
    prompts = [[(7 * i + j) % 300 + 3 for j in range(5 + 4 * i)] for i in range(5)]
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, max_tokens=5, ignore_eos=True, seed=i) for i in range(5)]
    single = LLMEngine(path, **kw)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        single.add_request(f"q{i}", p, sp)
    want = {}
    while single.has_unfinished_requests():
        want.update({o.request_id: o.outputs[0].token_ids for o in single.step() if o.finished})

    pre, dec = LLMEngine(path, **kw), LLMEngine(path, **kw)
    a = make_agent(kind, "pre", [pre.runner.kv.k, pre.runner.kv.v, pre.handoff.state_buffer])
    b = make_agent(kind, "dec", [dec.runner.kv.k, dec.runner.kv.v, dec.handoff.state_buffer],
                   accept=lambda peer, n: dec.check_generation(n.request_id, n.generation))
    a.add_peer("dec", b.metadata())
    b.add_peer("pre", a.metadata())
    lp = KVLayout.of(pre.runner.kv.k, pre.handoff.state_buffer)
    ld = KVLayout.of(dec.runner.kv.k, dec.handoff.state_buffer)
    res, handles, control, got = {}, {}, {}, {}
    for i, (p, sp) in enumerate(zip(prompts, params)):
        r = res[f"q{i}"] = dec.reserve_remote_prefill(f"q{i}", p, sp)
        pre.add_prefill_request(f"q{i}", p, sp, skip_tokens=r.num_cached_tokens, seed=r.seed)
        handles[f"q{i}"] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            pre.step()
            for ch in pre.pop_kv_chunks():
                if ch.ready is not None:  # GPU: the pages are final once the step's kernels ran
                    ch.ready.synchronize()
                r = res[ch.request_id]
                src, dst = chunk_regions(lp, ld, ch.page_ids, ch.first_page, r.page_ids,
                                         ch.state_slot, r.state_slot if ch.last else None)
                notif = TransferNotif("chunk", ch.request_id, r.generation, ch.index, ch.last, ch.first_page,
                                      len(ch.page_ids))
                handles[ch.request_id].append(a.write("dec", src, dst, encode_notif(notif)))
                if ch.last:
                    control[ch.request_id] = ch.model_state  # rides the control plane
            for peer, msg in b.notifications():
                n = decode_notif(msg)
                assert dec.commit_kv_chunk(n.request_id, n.generation, n.first_page, n.num_pages, n.last)
                if dec.remote_prefill_ready(n.request_id):  # NIXL may deliver the last chunk's notif first
                    dec.activate_remote_prefill(n.request_id, n.generation, None, control.pop(n.request_id))
                b.notify(peer, encode_notif(TransferNotif("ack", n.request_id, n.generation, n.chunk, n.last)))
            for peer, msg in a.notifications():
                n = decode_notif(msg)
                if n.kind == "ack" and n.last:
                    assert all(a.status(h) == "done" for h in handles[n.request_id])
                    for h in handles.pop(n.request_id):
                        a.release(h)
                    assert pre.release_prefill(n.request_id)
            got.update({o.request_id: o.outputs[0].token_ids for o in dec.step() if o.finished})
            if len(got) == len(prompts) and not handles:
                break
        assert got == want
        for eng in (pre, dec):
            assert eng.num_free_pages == eng.num_pages and not eng.has_unfinished_requests()
            assert eng.handoff.num_free_state_slots == len(eng.handoff.state_buffer)
        assert a.num_handles == 0 and b.num_refused == 0
    finally:
        a.close()
        b.close()
    assert a.num_registered == b.num_registered == a.num_peers == b.num_peers == 0
