"""Router pieces without processes: admission, stop strings, metric merging, how a request ends."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path

import pytest

from rlt_serve.sampling_params import SamplingParams
from router.admission import Admission, GroupTooLarge, NoCapacity, Overloaded
from router.errors import APIError, invalid
from router.generation import Choice, Generation
from router.metrics import RouterMetrics
from router.text_stream import TextStream
from router.worker_pool import WorkerPool, WorkerSpec
from workers.protocol import Delta

# -- admission --------------------------------------------------------------------------------


def _book(max_queue: int = 4, queue_timeout: float = 5.0, pages: int = 10, slots: int = 2) -> Admission:
    a = Admission(max_queue, queue_timeout)
    a.add_worker("w", page_size=16, total_pages=pages, total_slots=slots)
    return a


async def test_footprint_is_reserved_and_returned_exactly_once() -> None:
    a = _book()
    t = await a.acquire("r", num_tokens=33)  # ceil(33 / 16) = 3 pages
    w = a.workers["w"]
    assert (t.pages, w.reserved_pages, w.reserved_slots) == (3, 3, 1)
    assert a.release(t) is True
    assert a.release(t) is False  # a second ending returns nothing
    assert (w.reserved_pages, w.reserved_slots, a.outstanding()) == (0, 0, [])


async def test_queue_orders_by_priority_then_arrival() -> None:
    a = _book(slots=1)
    first = await a.acquire("busy", 16)
    order: list[str] = []

    async def wait(name: str, prio: int) -> None:
        t = await a.acquire(name, 16, priority=prio)
        order.append(name)
        a.release(t)

    tasks = [asyncio.create_task(wait(n, p)) for n, p in (("late-low", 5), ("a", 0), ("b", 0), ("urgent", -1))]
    await asyncio.sleep(0.01)
    assert a.queue_length == 4
    a.release(first)
    await asyncio.gather(*tasks)
    assert order == ["urgent", "a", "b", "late-low"]


async def test_bound_and_deadline_give_overloaded() -> None:
    a = _book(max_queue=1, queue_timeout=0.1, slots=1)
    held = await a.acquire("busy", 16)
    waiting = asyncio.create_task(a.acquire("queued", 16))
    await asyncio.sleep(0.01)
    with pytest.raises(Overloaded):
        await a.acquire("over", 16, priority=1)  # the queue is full and it would be last
    with pytest.raises(Overloaded) as e:
        await waiting  # waited past the queue deadline
    assert e.value.retry_after >= 1
    assert a.queue_length == 0
    a.release(held)
    assert a.workers["w"].reserved_slots == 0


async def test_cancelled_wait_reserves_nothing() -> None:
    a = _book(slots=1)
    held = await a.acquire("busy", 16)
    task = asyncio.create_task(a.acquire("gone", 16))
    await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    a.release(held)
    assert (a.workers["w"].reserved_slots, a.queue_length) == (0, 0)


async def test_reported_capacity_caps_promises() -> None:
    """Pages a worker still holds (an abort in flight) are not promised twice."""
    a = _book(pages=10)
    a.update_capacity("w", free_pages=2, total_pages=10, free_slots=2, total_slots=2)
    assert a.workers["w"].free_pages == 2
    task = asyncio.create_task(a.acquire("big", 16 * 5, timeout=1.0))
    await asyncio.sleep(0.01)
    assert not task.done()
    a.update_capacity("w", free_pages=10, total_pages=10, free_slots=2, total_slots=2)
    t = await task
    assert t.pages == 5


async def test_least_loaded_worker_and_dead_workers() -> None:
    a = Admission()
    a.add_worker("a", 16, 10, 4)
    a.add_worker("b", 16, 10, 4)
    t1 = await a.acquire("1", 64)
    t2 = await a.acquire("2", 16)
    assert {t1.worker_id, t2.worker_id} == {"a", "b"}
    a.remove_worker("a")
    a.remove_worker("b")
    with pytest.raises(NoCapacity):
        await a.acquire("3", 16)
    with pytest.raises(NoCapacity):
        await a.acquire("4", 16, worker_id="missing")


async def test_never_fitting_request_is_refused_at_once() -> None:
    a = _book(pages=2)
    with pytest.raises(NoCapacity):
        await a.acquire("huge", 16 * 3)


async def test_choices_of_one_request_are_granted_together() -> None:
    """No request holds part of its credits while it waits: with per-choice grants, `lax` (3
    choices) held the slot free on arrival and `urgent` (4, queued ahead of it) took the 3 that
    `busy` returned; each then waited for the other's until the queue deadline."""
    a = _book(slots=4, queue_timeout=5.0)
    busy = await a.acquire_group(["busy0", "busy1", "busy2"], [16] * 3)
    lax = asyncio.create_task(a.acquire_group([f"lax{i}" for i in range(3)], [16] * 3, priority=1))
    await asyncio.sleep(0.01)
    assert not lax.done() and a.workers["w"].reserved_slots == 3  # nothing held while waiting
    urgent = asyncio.create_task(a.acquire_group([f"urgent{i}" for i in range(4)], [16] * 4, priority=0))
    await asyncio.sleep(0.01)
    for t in busy:
        a.release(t)
    got = await asyncio.wait_for(urgent, 1.0)
    assert [t.request_id for t in got] == [f"urgent{i}" for i in range(4)] and not lax.done()
    for t in got:
        a.release(t)
    for t in await asyncio.wait_for(lax, 1.0):
        a.release(t)
    assert (a.workers["w"].reserved_slots, a.outstanding(), a.queue_length) == (0, [], 0)


async def test_choices_that_never_fit_together_are_refused_at_once() -> None:
    a = Admission(queue_timeout=30.0)
    a.add_worker("a", 16, 10, 2)
    a.add_worker("b", 16, 10, 2)
    started = time.monotonic()
    with pytest.raises(GroupTooLarge, match="5 choices .* at most 4 requests"):
        await a.acquire_group([f"r{i}" for i in range(5)], [16] * 5)
    assert time.monotonic() - started < 1.0
    got = await a.acquire_group([f"r{i}" for i in range(4)], [16] * 4)  # 4 fit: two on each worker
    assert sorted(t.worker_id for t in got) == ["a", "a", "b", "b"]
    for t in got:
        a.release(t)
    assert a.outstanding() == []


async def test_mixed_size_choices_are_packed_largest_first() -> None:
    """Two workers of 10 pages: choices of 5, 5 and 10 pages fit (10 on one, 5 + 5 on the other),
    which placing them in arrival order on the least loaded worker (5 | 5, then 10 nowhere)
    reported as never fitting."""
    a = Admission(queue_timeout=30.0)
    a.add_worker("a", 16, 10, 4)
    a.add_worker("b", 16, 10, 4)
    got = await asyncio.wait_for(a.acquire_group(["s0", "s1", "big"], [16 * 5, 16 * 5, 16 * 10]), 1.0)
    assert [t.request_id for t in got] == ["s0", "s1", "big"]
    assert got[0].worker_id == got[1].worker_id != got[2].worker_id
    for t in got:
        a.release(t)
    assert (a.workers["a"].reserved_pages, a.workers["b"].reserved_pages, a.outstanding()) == (0, 0, [])


async def test_too_many_choices_is_a_400_and_reserves_nothing() -> None:
    a = _book(slots=2)
    pool = _Pool(a)
    params = SamplingParams(max_tokens=20)
    choices = [Choice(i, [1, 2, 3], params) for i in range(3)]
    gen = Generation("req", choices, pool, a, RouterMetrics(pool, a), _CharTokenizer(), deadline=time.time() + 5)
    with pytest.raises(APIError) as e:
        await gen.start()
    assert (e.value.status, e.value.param) == (400, "n") and "3 choices" in e.value.message
    gen.close()
    assert (pool.sent, a.outstanding(), a.workers["w"].reserved_slots) == ([], [], 0)


# -- stop strings ------------------------------------------------------------------------------


class _CharTokenizer:
    """One token per character: enough for IncrementalDetokenizer."""

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids)


def _stream(text: str, stop: list[str], **kw) -> tuple[TextStream, list[str]]:
    ts = TextStream(_CharTokenizer(), stop, **kw)  # type: ignore[arg-type]
    sent = []
    for ch in text:
        stopped = ts.push(ord(ch))
        sent.append(ts.take())
        if stopped:
            break
    ts.finish()
    sent.append(ts.take())
    return ts, sent


def test_stop_string_cuts_and_nothing_leaks() -> None:
    ts, sent = _stream("hello world, bye", ["wor", "ld,"])
    assert ts.text == "hello " and ts.stop_reason == "wor" and "".join(sent) == "hello "
    assert ts.num_tokens == len("hello wor")
    ts, sent = _stream("abcabd", ["abd"])
    assert "".join(sent) == "abc" and ts.text == "abc"
    assert sent[:2] == ["", ""]  # "a", "ab" could start the stop string: held back


def test_include_stop_and_min_tokens() -> None:
    ts, _ = _stream("xaay", ["aa"], include_stop=True)
    assert ts.text == "xaa"
    ts, sent = _stream("aa-aa-", ["aa"], min_tokens=3)  # the first "aa" is too early to stop
    assert ts.text == "aa-" and "".join(sent) == "aa-"


def test_no_stop_strings_streams_everything() -> None:
    ts, sent = _stream("plain", [])
    assert ts.text == "plain" and sent[:5] == list("plain") and ts.stop_reason is None


# -- errors and metrics ------------------------------------------------------------------------


def test_engine_errors_name_their_field() -> None:
    err = invalid("num_loops: 9 exceeds the engine's max_loops=4 depth slots")
    assert err.status == 400 and err.param == "num_loops"
    assert invalid("engine step failed: boom").param is None


def test_worker_metrics_are_relabelled_and_merged() -> None:
    a = Admission()
    pool = WorkerPool(
        "inproc://unused", [WorkerSpec("0", "both", "inproc://0"), WorkerSpec("1", "both", "inproc://1")], a
    )
    text = (
        "# HELP rlt:num_requests_running Running.\n# TYPE rlt:num_requests_running gauge\n"
        "rlt:num_requests_running {n}\n"
        "# HELP rlt:request_success Finished.\n# TYPE rlt:request_success counter\n"
        'rlt:request_success_total{{finished_reason="stop"}} {n}\n'
    )
    pool.workers["0"].metrics_text = text.format(n=1)
    pool.workers["1"].metrics_text = text.format(n=2)
    out = RouterMetrics(pool, a).render().decode()
    assert 'rlt:num_requests_running{worker="0"} 1.0' in out
    assert 'rlt:num_requests_running{worker="1"} 2.0' in out
    assert 'rlt:request_success_total{finished_reason="stop",worker="1"} 2.0' in out
    assert out.count("# TYPE rlt:num_requests_running gauge") == 1  # one family, every worker
    assert 'rlt:worker_up{worker="0"} 0.0' in out and "rlt:router_queue_length 0.0" in out


# -- a generation's ending ---------------------------------------------------------------------


class _Pool(WorkerPool):
    """Records what would go to the worker; deltas are fed by the test."""

    def __init__(self, admission: Admission) -> None:
        super().__init__("inproc://unused", [WorkerSpec("w", "both", "inproc://w")], admission)
        self.sent: list[str] = []
        self.aborted: list[str] = []

    def submit(self, worker_id, msg, sink) -> None:
        self.sent.append(msg.request_id)
        self.sink = sink

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def _generation(deadline_s: float, stop: list[str] | None = None):
    a = _book()
    pool = _Pool(a)
    params = SamplingParams(max_tokens=20, stop=stop)
    gen = Generation("req", [Choice(0, [1, 2, 3], params)], pool, a, RouterMetrics(pool, a), _CharTokenizer(),
                     deadline=time.time() + deadline_s)  # fmt: skip
    return gen, pool, a


async def test_deadline_ends_the_request_and_returns_credits() -> None:
    gen, pool, a = _generation(0.2)
    await gen.start()
    assert a.workers["w"].reserved_slots == 1 and pool.sent == ["req-0"]
    with pytest.raises(APIError) as e:
        async for _ in gen.events():
            pass
    assert e.value.status == 504
    gen.close()
    gen.close()
    assert pool.aborted == ["req-0"] and a.workers["w"].reserved_slots == 0 and a.outstanding() == []


@pytest.mark.parametrize("ticks", range(8))
async def test_client_gone_while_admitted_returns_every_credit(ticks: int) -> None:
    """The client goes away `ticks` loop turns after its credits were granted (the window in which
    the grant may be done but `start` not yet resumed): as in serving, the task is cancelled and
    the generation closed at once. Nothing stays reserved and nothing is dispatched."""
    gen, pool, a = _generation(5.0)
    blocker = await a.acquire("blocker", 16 * 10)  # every page: the request must wait
    task = asyncio.ensure_future(gen.start())
    for _ in range(10):
        if a.queue_length:
            break
        await asyncio.sleep(0)
    assert a.queue_length == 1
    a.release(blocker)  # granted now
    for _ in range(ticks):
        await asyncio.sleep(0)
    task.cancel()
    gen.close()
    await asyncio.gather(task, return_exceptions=True)
    w = a.workers["w"]
    assert (w.reserved_pages, w.reserved_slots, a.outstanding()) == (0, 0, [])
    if not task.cancelled():  # it had already finished starting: then close() aborted it
        assert pool.aborted == pool.sent == ["req-0"]
    else:
        assert pool.sent == []


async def test_stop_string_aborts_the_worker_request_at_once() -> None:
    gen, pool, a = _generation(5.0, stop=["cd"])
    await gen.start()
    pool.sink.put_nowait(Delta("req-0", [ord(c) for c in "abcdef"]))
    events = [ev async for ev in gen.events()]
    assert events[-1].finish_reason == "stop" and events[-1].stop_reason == "cd"
    assert "".join(ev.text for ev in events) == "ab" and events[-1].token_ids == [ord(c) for c in "abcd"]
    assert pool.aborted == ["req-0"] and a.workers["w"].reserved_slots == 0
    gen.close()
    assert a.workers["w"].reserved_pages == 0


async def test_engine_refusal_is_a_400_and_a_dead_worker_a_503() -> None:
    gen, pool, _ = _generation(5.0)
    await gen.start()
    pool.sink.put_nowait(Delta("req-0", [], finish_reason="error", error="num_loops: 9 exceeds max_loops=4"))
    with pytest.raises(APIError) as e:
        async for _ in gen.events():
            pass
    assert (e.value.status, e.value.param) == (400, "num_loops")
    gen, pool, _ = _generation(5.0)
    await gen.start()
    pool.sink.put_nowait(Delta("req-0", [], finish_reason="error", error="worker w failed: killed"))
    with pytest.raises(APIError) as e:
        async for _ in gen.events():
            pass
    assert e.value.status == 503


def test_dashboards_use_declared_metric_names() -> None:
    """Static half of the dashboard check (the live half scrapes a server in test_router_api)."""
    from router.metrics import ROUTER_METRIC_NAMES
    from workers.metrics import METRIC_NAMES

    known = set(METRIC_NAMES) | set(ROUTER_METRIC_NAMES)
    root = Path(__file__).resolve().parent.parent / "grafana"
    dashboards = sorted(root.glob("*.json"))
    assert {p.stem for p in dashboards} >= {"rlt-overview", "rlt-kv-loops", "rlt-speculation", "rlt-pd-transfer"}
    for path in dashboards:
        used = set(re.findall(r"rlt:[A-Za-z0-9_:]+", path.read_text()))
        base = {re.sub(r"_(bucket|sum|count)$", "", n) for n in used}
        assert base <= known, f"{path.name}: unknown metrics {sorted(base - known)}"
    a = Admission()
    pool = WorkerPool("inproc://unused", [WorkerSpec("0", "both", "inproc://0")], a)
    out = RouterMetrics(pool, a).render().decode()
    assert all(name in out for name in ROUTER_METRIC_NAMES)
