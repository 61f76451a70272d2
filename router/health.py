"""Readiness: a worker counts as serving only after a real generation succeeded on it.

`Ready` says a worker loaded its engine; it does not prove the engine can run a step (kernels,
memory, a broken checkpoint). So each worker, once Ready, runs a one-token request through the
whole path (admission, ZMQ, engine, deltas), and /health turns 200 only after one succeeded.
With prefill/decode disaggregation a warm-up is a whole handoff: pinned to the new worker, with any
live worker of the other role (waited for, since PD workers may join in any order), and /health
needs a warm worker of each role.
"""

from __future__ import annotations

import asyncio
import logging
import time

from rlt_serve.sampling_params import SamplingParams
from rlt_serve.tokenizer import Tokenizer
from router.admission import Admission
from router.generation import Choice, Generation
from router.metrics import RouterMetrics
from router.pd import PDRouter
from router.worker_pool import WorkerPool

log = logging.getLogger("rlt_serve.router")

WARMUP_ATTEMPTS = 5
WARMUP_TIMEOUT_S = 120.0


async def _counterpart(worker_id: str, pool: WorkerPool, admission: Admission, role: str) -> bool:
    """Wait until a worker of `role` is admissible (PD warm-up), as long as `worker_id` lives."""
    end = time.monotonic() + WARMUP_TIMEOUT_S
    while time.monotonic() < end:
        if not pool.workers[worker_id].alive:
            return False
        if any(w.role == role and w.accepting for w in admission.workers.values()):
            return True
        await asyncio.sleep(0.1)
    return False


async def warm_up(
    worker_id: str, pool: WorkerPool, admission: Admission, tokenizer: Tokenizer, pd: PDRouter | None = None
) -> bool:
    """One greedy token on `worker_id`; retried a few times, since start-up can be noisy."""
    prompt = tokenizer.encode("Hello", add_special_tokens=True) or [0]
    metrics = RouterMetrics(pool, admission)  # not exported: warm-ups are not traffic
    role = pool.workers[worker_id].spec.role
    for attempt in range(WARMUP_ATTEMPTS):
        st = pool.workers[worker_id]
        if not st.alive:
            return False
        if pd is not None and not await _counterpart(worker_id, pool, admission, "decode" if role == "prefill" else "prefill"):
            return False
        choice = Choice(index=0, prompt_ids=prompt, params=SamplingParams(max_tokens=1, temperature=0.0))
        pins = {"prefill_worker_id": worker_id} if role == "prefill" else {"worker_id": worker_id}
        gen = Generation(
            f"warmup-{worker_id}-{attempt}", [choice], pool, admission, metrics, tokenizer,
            deadline=time.time() + WARMUP_TIMEOUT_S, pd=pd, **pins,
        )  # fmt: skip
        try:
            await gen.start()
            async for _ in gen.events():
                pass
            if choice.token_ids:
                st.warm = True
                log.info("worker %s warmed up", worker_id)
                return True
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.warning("warm-up of worker %s failed (attempt %d): %s", worker_id, attempt + 1, e)
        finally:
            gen.close()
        await asyncio.sleep(1.0)
    return False


def report(pool: WorkerPool) -> tuple[int, dict]:
    """/health: 200 while some worker serves (status `degraded` if another died), else 503.

    With PD, "serves" needs a warm prefill worker and a warm decode worker."""
    workers = {wid: st.describe() for wid, st in pool.workers.items()}
    serving = [st for st in pool.workers.values() if st.serving and st.warm]
    if pool.pd and {st.spec.role for st in serving} != {"prefill", "decode"}:
        serving = []
    if not serving:
        starting = any(st.alive for st in pool.workers.values())
        status = "starting" if starting else "unavailable"
        return 503, {"status": status, "workers": workers}
    dead = any(not st.alive for st in pool.workers.values())
    return 200, {"status": "degraded" if dead else "ok", "workers": workers}
