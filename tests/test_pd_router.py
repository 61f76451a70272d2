"""The router's PD driver against a recording pool: message order, teardown order, exactly once.

No processes: the pool records what would be sent, and the test plays the workers' replies. This
pins down what the process tests can only observe from outside: the decode worker is never told to
free pages before the prefill worker confirmed that its writes stopped.
"""

from __future__ import annotations

import asyncio

import pytest

from router.admission import Admission
from router.pd import PDRouter, PDTimeouts
from workers.protocol import (
    Abort,
    Activate,
    Committed,
    Prefill,
    PrefillDone,
    PrefillReleased,
    Release,
    Reserve,
    Reserved,
)


class FakePool:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []
        self.dead: set[str] = set()
        self.handlers: dict = {}
        self.streams: dict[str, asyncio.Queue] = {}
        self.failed: dict[str, str] = {}
        self.on_dead: list = []

    def send(self, worker_id: str, msg) -> bool:
        if worker_id in self.dead:
            return False
        self.sent.append((worker_id, msg))
        return True

    def open_stream(self, rid, wid, sink) -> None:
        self.streams[rid] = sink

    def forget(self, rid) -> None:
        self.streams.pop(rid, None)

    def abort(self, rid) -> None:
        self.streams.pop(rid, None)

    def fail_stream(self, rid, error) -> bool:
        if rid not in self.streams:
            return False
        self.streams.pop(rid)
        self.failed[rid] = error
        return True

    def set_pd_handler(self, rid, handler) -> None:
        if handler is None:
            self.handlers.pop(rid, None)
        else:
            self.handlers[rid] = handler

    def mark_dead(self, wid, reason) -> None:
        self.dead.add(wid)
        for hook in self.on_dead:
            hook(wid, reason)

    def reply(self, msg) -> None:
        self.handlers[msg.request_id](msg)

    def kinds(self, worker_id: str | None = None) -> list[str]:
        return [type(m).__name__ for w, m in self.sent if worker_id is None or w == worker_id]


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def _setup(stop: float = 5.0, prefill_workers: tuple[str, ...] = ("p",)):
    pool = FakePool()
    adm = Admission()
    adm.add_worker("d", 4, 100, 4, "decode")
    for p in prefill_workers:
        adm.add_worker(p, 4, 100, 4, "prefill")
    pd = PDRouter(pool, adm, PDTimeouts(reserve=5, prefill=5, transfer=5, activate=5, stop=stop))  # type: ignore[arg-type]
    dt = await adm.acquire("r", 20, role="decode")
    pt = await adm.acquire("r", 8, worker_id=prefill_workers[0], role="prefill")
    pd.start("r", [1] * 8, {"seed": 1}, deadline=1e12, priority=0, decode=dt, prefill=pt, sink=asyncio.Queue())
    await _settle()
    return pool, adm, pd


async def _to_prefilling(pool: FakePool) -> None:
    pool.reply(Reserved("r", "d", generation=7, page_ids=[3, 4], num_cached_tokens=0, seed=11, state_slot=2))
    await _settle()


async def test_happy_path_order_and_release() -> None:
    pool, adm, pd = await _setup()
    assert pool.sent == [("d", pool.sent[0][1])] and isinstance(pool.sent[0][1], Reserve)
    await _to_prefilling(pool)
    (wid, pre) = pool.sent[-1]
    assert wid == "p" and isinstance(pre, Prefill)
    assert (pre.page_ids, pre.generation, pre.seed, pre.state_slot, pre.decode_worker) == ([3, 4], 7, 11, 2, "d")
    pool.reply(PrefillDone("r", "p", generation=6))  # a stale generation: ignored
    await _settle()
    assert pool.kinds() == ["Reserve", "Prefill"]
    pool.reply(PrefillDone("r", "p", generation=7, chunks=[(0, 2)], num_writes=2))
    await _settle()
    act = pool.sent[-1][1]
    assert isinstance(act, Activate) and act.chunks == [(0, 2)] and act.num_writes == 2
    pool.reply(Committed("r", "d", 7))
    await _settle()
    assert isinstance(pool.sent[-1][1], Release) and pd.phase_counts()["decoding"] == 1
    pool.reply(PrefillReleased("r", "p"))
    await _settle()
    assert not pd.requests and not pool.handlers
    assert [t.worker_id for t in adm.outstanding()] == ["d"]  # the decode ticket stays with the Generation


async def test_cancel_while_prefilling_stops_the_writer_first() -> None:
    pool, adm, pd = await _setup()
    await _to_prefilling(pool)
    pd.cancel("r")
    await _settle()
    assert pool.kinds() == ["Reserve", "Prefill", "Abort"] and pool.sent[-1][0] == "p"
    await asyncio.sleep(0.05)
    assert pool.kinds("d") == ["Reserve"], "decode must not free pages while writes may land"
    pool.reply(PrefillReleased("r", "p"))
    await _settle()
    assert pool.sent[-1] == ("d", Abort("r"))
    assert not pd.requests and [t.worker_id for t in adm.outstanding()] == ["d"]


async def test_writer_that_never_confirms_is_declared_dead_before_decode_frees() -> None:
    pool, _, pd = await _setup(stop=0.1)
    await _to_prefilling(pool)
    pd.cancel("r")
    await asyncio.sleep(0.3)
    assert "p" in pool.dead
    assert pool.sent[-1] == ("d", Abort("r"))
    assert not pd.requests


async def test_decode_death_fails_the_request_once_and_releases_the_prefill() -> None:
    pool, _, pd = await _setup()
    await _to_prefilling(pool)
    pool.mark_dead("d", "killed")
    await _settle()
    assert "worker d (decode) failed: killed" in pool.failed["r"]
    assert pool.sent[-1] == ("p", Abort("r"))
    pool.reply(PrefillReleased("r", "p"))
    await _settle()
    assert pool.kinds("d") == ["Reserve"] and not pd.requests


async def test_prefill_failure_reported_by_the_worker() -> None:
    pool, _, pd = await _setup()
    await _to_prefilling(pool)
    pool.reply(PrefillDone("r", "p", generation=7, error="KV transfer to worker d timed out after 3s"))
    await _settle()
    assert pool.failed["r"].startswith("worker p (prefill): KV transfer")
    assert pool.kinds() == ["Reserve", "Prefill", "Abort"] and pool.sent[-1][0] == "d"  # it released already
    assert not pd.requests


async def test_reservation_refused_is_the_requests_own_error() -> None:
    pool, _, pd = await _setup()
    pool.reply(Reserved("r", "d", error="exit_threshold: early exit needs kv_layout='last_exited'"))
    await _settle()
    assert pool.failed["r"].startswith("exit_threshold:")
    assert pool.kinds("p") == [] and not pd.requests


async def test_a_role_waiting_for_credits_does_not_block_the_other() -> None:
    adm = Admission()
    adm.add_worker("d", 4, 10, 1, "decode")
    adm.add_worker("p", 4, 10, 4, "prefill")
    await adm.acquire("a", 8, role="decode")  # the decode worker's only slot
    blocked = asyncio.ensure_future(adm.acquire("b", 8, role="decode"))
    await _settle()
    got = await asyncio.wait_for(adm.acquire("a", 8, role="prefill"), 1.0)  # not queued behind "b"
    assert got.worker_id == "p" and not blocked.done()
    blocked.cancel()
    with pytest.raises(asyncio.CancelledError):
        await blocked


def _die(pool: FakePool, adm: Admission, wid: str) -> None:
    adm.remove_worker(wid)  # what the real pool does before its death hooks
    pool.mark_dead(wid, "killed")


async def test_prefill_death_before_the_prompt_went_out_is_retried_elsewhere() -> None:
    pool, adm, pd = await _setup(prefill_workers=("p", "p2"))
    _die(pool, adm, "p")  # while reserving: nothing was computed or written
    await _settle()
    assert "r" not in pool.failed and pd.phase_counts()["reserving"] == 1
    await _to_prefilling(pool)
    await asyncio.sleep(0.02)  # the replacement ticket is acquired in a task of its own
    wid, pre = pool.sent[-1]
    assert wid == "p2" and isinstance(pre, Prefill) and (pre.page_ids, pre.generation) == ([3, 4], 7)
    assert sorted(t.worker_id for t in adm.outstanding()) == ["d", "p2"]  # p's ticket came back, once
    assert adm.workers["p"].reserved_slots == 0
    pool.reply(PrefillDone("r", "p2", generation=7, chunks=[(0, 2)], num_writes=2))
    await _settle()
    pool.reply(Committed("r", "d", 7))
    await _settle()
    pool.reply(PrefillReleased("r", "p2"))
    await _settle()
    assert pool.kinds("d") == ["Reserve", "Activate"]  # one reservation, never aborted or redone
    assert not pd.requests and [t.worker_id for t in adm.outstanding()] == ["d"]


async def test_prefill_death_with_no_other_prefill_worker_fails_once() -> None:
    pool, adm, pd = await _setup()
    _die(pool, adm, "p")
    await _to_prefilling(pool)
    await asyncio.sleep(0.02)  # the replacement ticket is acquired in a task of its own
    assert "worker p (prefill) failed" in pool.failed["r"] and "no other prefill worker" in pool.failed["r"]
    assert pool.kinds("d") == ["Reserve", "Abort"] and pool.kinds("p") == []
    assert not pd.requests and [t.worker_id for t in adm.outstanding()] == ["d"]


async def test_cancel_while_waiting_for_a_replacement_prefill_ticket() -> None:
    pool, adm, pd = await _setup(prefill_workers=("p", "p2"))
    blocker = await adm.acquire("other", 400, worker_id="p2", role="prefill")  # p2 is full: the retry waits
    _die(pool, adm, "p")
    await _to_prefilling(pool)
    await asyncio.sleep(0.02)  # the replacement ticket is acquired in a task of its own
    assert adm.queue_length == 1 and "r" not in pool.failed
    pd.cancel("r")
    await _settle()
    assert adm.queue_length == 0 and pool.kinds("d") == ["Reserve", "Abort"] and not pd.requests
    assert [t.worker_id for t in adm.outstanding()] == ["d", "p2"] and blocker in adm.outstanding()


async def test_prefill_death_after_the_prompt_went_out_fails() -> None:
    pool, adm, pd = await _setup(prefill_workers=("p", "p2"))
    await _to_prefilling(pool)
    await asyncio.sleep(0.02)  # the replacement ticket is acquired in a task of its own
    _die(pool, adm, "p")  # it may have written: the request fails, the decode side frees once
    await _settle()
    assert "worker p (prefill) failed: killed" in pool.failed["r"]
    assert pool.kinds("d") == ["Reserve", "Abort"] and pool.kinds("p2") == []
    assert not pd.requests
