"""`rlt-serve launch`: start the workers, wait until each is ready, then serve the router.

Workers are separate processes (one engine each) reached over ipc:// sockets in a private run
directory; the router runs in this process under uvicorn. `--prefill P --decode D` starts
prefill/decode disaggregation (P prefill and D decode workers, see `router.pd`); `--worker-port`
also binds the router's worker endpoint on TCP, so workers started elsewhere
(`rlt-serve worker --router tcp://HOST:PORT`) can join, and P or D may then be 0. Loading is waited for before the port
opens, so a client never meets a half-started server. While serving, a worker that exits is
reported and handed to the router's pool as dead, so its requests fail instead of hanging. On
SIGINT/SIGTERM uvicorn stops accepting and finishes open responses (bounded), then the workers
are told to shut down and killed if they do not; nothing is left running.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import typing

from workers.process import WorkerLaunch, WorkerProcess, stop_all
from workers.protocol import Ready


def _engine_fields() -> dict[str, type]:
    """EngineConfig's fields and their scalar types: each becomes a --flag, kept in sync."""
    from rlt_serve.config import EngineConfig

    out = {}
    for name, hint in typing.get_type_hints(EngineConfig).items():
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        out[name] = args[0] if args else hint
    return out


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory (default: the built-in demo model)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: --model as given)")
    p.add_argument("--workers", type=int, default=None, help="worker processes in role 'both' (default 1)")
    p.add_argument("--prefill", type=int, default=None, help="prefill workers (prefill/decode disaggregation)")
    p.add_argument("--decode", type=int, default=None, help="decode workers (prefill/decode disaggregation)")
    p.add_argument("--kv-transport", default="nixl", choices=["nixl", "zmq"],
                   help="PD: how KV moves between workers (nixl: UCX, device memory on GPU; zmq: copies)")  # fmt: skip
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0,
                   help="PD: seconds one KV write (and the activation after it) may take")  # fmt: skip
    p.add_argument("--kv-transfer-budget-bytes", type=int, default=256 << 20,
                   help="PD: KV bytes a prefill worker keeps in flight")  # fmt: skip
    p.add_argument("--kv-reservation-timeout", type=float, default=None,
                   help="PD: seconds a decode worker holds pages for a prompt that is never activated (default: "
                        "the request timeout plus the transfer timeout plus 30, past every router bound)")  # fmt: skip
    p.add_argument("--worker-host", default="127.0.0.1", help="with --worker-port: the interface to bind")
    p.add_argument("--worker-port", type=int, default=None,
                   help="also accept workers that join over tcp://WORKER_HOST:PORT (0: a free port, printed)")  # fmt: skip
    p.add_argument("--heartbeat-timeout", type=float, default=3.0, help="seconds of silence before a worker is dead")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed at start)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--api-key", default=os.environ.get("RLT_SERVE_API_KEY"), help="require this Bearer token")
    p.add_argument("--max-queue", type=int, default=1024, help="requests waiting for credits before 429")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all")
    p.add_argument("--max-body-bytes", type=int, default=8 << 20)
    p.add_argument("--load-timeout", type=float, default=600.0, help="seconds each worker may take to load")
    p.add_argument("--shutdown-timeout", type=float, default=10.0, help="bound on each shutdown phase, seconds")
    p.add_argument("--uvicorn-log-level", default="warning")
    add_engine_arguments(p)


def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """One flag per EngineConfig field (launch and `rlt-serve worker` take the same ones)."""
    eng = p.add_argument_group("engine options (EngineConfig; unset ones keep the engine's defaults)")
    for name, typ in _engine_fields().items():
        flag = "--" + name.replace("_", "-")
        if typ is bool:
            eng.add_argument(flag, dest=name, action=argparse.BooleanOptionalAction, default=None)
        else:
            eng.add_argument(flag, dest=name, type=typ, default=None, metavar=typ.__name__.upper())


def engine_args(args: argparse.Namespace) -> dict:
    return {name: getattr(args, name) for name in _engine_fields() if getattr(args, name) is not None}


def worker_engine_args(args: argparse.Namespace, index: int) -> dict:
    """`engine_args` of worker `index`: its engine seed is the launch seed plus its index, so the
    workers draw different seeds for unseeded requests (with one seed, the i-th unseeded request
    of every worker sampled the same tokens: the n choices of one request came back identical)."""
    eng = engine_args(args)
    return {**eng, "seed": eng.get("seed", 0) + index}


def _gpu_ids() -> list[str]:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [x.strip() for x in visible.split(",") if x.strip()]
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [str(i) for i, line in enumerate(l for l in listing.splitlines() if l.startswith("GPU "))]


def _device_envs(device: str, n: int) -> list[dict[str, str]]:
    """Where each worker computes: one GPU each when there are enough, else a share of the CPU.

    CPU workers split the cores between them: each engine's thread pool would otherwise spin on
    every core, and N of them contending slows every step several-fold. An OMP_NUM_THREADS the
    user set is left alone."""
    if n == 0:
        return []
    ids = [] if device == "cpu" else _gpu_ids()
    if len(ids) >= n:
        return [{"CUDA_VISIBLE_DEVICES": ids[i]} for i in range(n)]
    if ids:
        if n > 1:
            print(f"rlt-serve: {n} workers share {len(ids)} GPU(s); lower --gpu-memory-utilization", file=sys.stderr)
        return [{} for _ in range(n)]
    if "OMP_NUM_THREADS" in os.environ:
        return [{} for _ in range(n)]
    threads = max(1, len(os.sched_getaffinity(0)) // n)
    return [{"OMP_NUM_THREADS": str(threads)} for _ in range(n)]


def _bar(done: int, total: int, width: int = 20) -> str:
    filled = width * done // total
    return "[" + "#" * filled + "-" * (width - filled) + f"] {done}/{total}"


def _wait_ready(procs: list[WorkerProcess], timeout: float, stop: threading.Event) -> str | None:
    """Block until every worker is Ready, printing progress; an error message if one is not."""
    shown: dict[str, str] = {}
    while not stop.is_set():
        for p in procs:
            wid = p.spec.worker_id
            if p.ready is not None and shown.get(wid) != "ready":
                shown[wid] = "ready"
                r: Ready = p.ready
                done = sum(q.ready is not None for q in procs)
                print(
                    f"rlt-serve: loading {_bar(done, len(procs))} worker {wid} ready (pid {r.pid}) in "
                    f"{time.monotonic() - p.started:.1f}s: {r.total_pages} KV pages x {r.page_size} tokens, "
                    f"max_model_len {r.max_model_len}, max_num_seqs {r.max_num_seqs}",
                    flush=True,
                )
            elif p.ready is None and p.last_status is not None and shown.get(wid) != p.last_status.stage:
                shown[wid] = p.last_status.stage
                print(
                    f"rlt-serve: worker {wid} (pid {p.pid}) {p.last_status.stage} {p.last_status.detail}".rstrip(),
                    flush=True,
                )
            if p.ready is None and p.exit_code() is not None:
                p.reap()
                return p.describe_exit() + " while loading"
            if p.ready is None and time.monotonic() - p.started > timeout:
                return f"worker {wid} (pid {p.pid}) was not ready within --load-timeout={timeout:g}s"
        if all(p.ready is not None for p in procs):
            return None
        for p in procs:
            p.changed.clear()
        procs[0].changed.wait(0.1)
    return None


async def _supervise(server, app, procs: list[WorkerProcess], announce: str) -> None:
    """Print the endpoints once listening; report each worker that exits to the router's pool."""
    dead: set[str] = set()
    announced = False
    while True:
        await asyncio.sleep(0.1)
        if not announced and server.started:
            announced = True
            host, port = server.servers[0].sockets[0].getsockname()[:2]
            base = f"http://{host}:{port}"
            text = announce.replace("{base}", base)
            pool = getattr(app.state, "pool", None)
            for addr in pool.bound_addrs() if pool is not None else []:
                text += f"\n  workers join at: {addr}"
            print(text, flush=True)
        for p in procs:
            wid = p.spec.worker_id
            if wid in dead or p.exit_code() is None:
                continue
            dead.add(wid)
            reason = p.describe_exit()
            print(f"rlt-serve: {reason}", file=sys.stderr, flush=True)
            pool = getattr(app.state, "pool", None)
            if pool is not None:
                result = pool.mark_dead(wid, reason)
                if inspect.isawaitable(result):
                    await result


async def _serve(server, app, procs: list[WorkerProcess], announce: str) -> None:
    supervisor = asyncio.create_task(_supervise(server, app, procs, announce))
    try:
        await server.serve()
    finally:
        supervisor.cancel()


def roles(args: argparse.Namespace) -> list[str] | str:
    """The role of each worker to start, or why the options do not fit together."""
    if args.prefill is None and args.decode is None:
        n = args.workers if args.workers is not None else 1
        if n < 0 or (n == 0 and args.worker_port is None):
            return "--workers must be >= 1 (or 0 with --worker-port, for workers that join)"
        return ["both"] * n
    if args.workers is not None:
        return "--workers starts workers in role 'both'; it cannot be combined with --prefill/--decode"
    p, d = args.prefill or 0, args.decode or 0
    if p < 0 or d < 0:
        return "--prefill and --decode must be >= 0"
    if (p == 0 or d == 0) and args.worker_port is None:
        return "prefill/decode disaggregation needs --prefill >= 1 and --decode >= 1 (or --worker-port, for workers that join)"
    return ["prefill"] * p + ["decode"] * d


def pd_unsupported(args: argparse.Namespace) -> str | None:
    """Engine options the handoff cannot serve, refused before anything starts."""
    if args.kv_transport == "nixl":
        from workers.transfer.nixl_agent import nixl_unavailable

        why = nixl_unavailable()
        if why is not None:
            return f"--kv-transport nixl: {why}; or choose --kv-transport zmq"
    return None


def run(args: argparse.Namespace) -> int:
    plan = roles(args)
    if isinstance(plan, str):
        print(f"rlt-serve launch: {plan}", file=sys.stderr)
        return 2
    pd = args.prefill is not None or args.decode is not None
    if pd and (why := pd_unsupported(args)) is not None:
        print(f"rlt-serve launch: {why}", file=sys.stderr)
        return 2
    n = len(plan)
    if args.model:
        model, name = args.model, args.served_model_name or args.model
    else:
        from rlt_serve.demo import DEMO_NAME, ensure_demo

        model, name = ensure_demo(), args.served_model_name or DEMO_NAME

    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda s, f: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    run_dir = tempfile.mkdtemp(prefix="rlt-serve-")
    router_addr = f"ipc://{run_dir}/router"
    procs: list[WorkerProcess] = []
    try:
        counts: dict[str, int] = {}
        for index, (role, env) in enumerate(zip(plan, _device_envs(args.device, n))):
            k = counts[role] = counts.get(role, 0) + 1
            wid = str(k - 1) if role == "both" else f"{role[0]}{k - 1}"  # 0, 1, ... or p0, d0, ...
            spec = WorkerLaunch(
                worker_id=wid,
                role=role,  # type: ignore[arg-type]
                model=model,
                in_addr=f"ipc://{run_dir}/worker-{wid}",
                out_addr=router_addr,
                device=args.device,
                dtype=args.dtype,
                engine_args=worker_engine_args(args, index),
                env=env,
                pd_args=pd_worker_args(args) if role != "both" else [],
            )
            procs.append(WorkerProcess(spec))
        if procs:
            print(f"rlt-serve: loading {model} in {n} worker(s): pids {', '.join(str(p.pid) for p in procs)}",
                  flush=True)  # fmt: skip
        error = _wait_ready(procs, args.load_timeout, stop)
        if error is not None:
            print(f"rlt-serve launch: {error}", file=sys.stderr)
            return 1
        if stop.is_set():
            return 0
        return _serve_router(args, model, name, router_addr, procs)
    finally:
        stop_all(procs, args.shutdown_timeout)
        shutil.rmtree(run_dir, ignore_errors=True)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def pd_worker_args(args: argparse.Namespace) -> list[str]:
    """The command-line options a PD worker takes from `launch`'s."""
    return ["--kv-transport", args.kv_transport, "--kv-transfer-timeout", str(args.kv_transfer_timeout),
            "--kv-transfer-budget-bytes", str(args.kv_transfer_budget_bytes),
            "--kv-reservation-timeout", str(reservation_timeout(args))]  # fmt: skip


def reservation_timeout(args: argparse.Namespace) -> float:
    """The decode side's bound on an unactivated reservation: past the router's (it tears down first)."""
    if args.kv_reservation_timeout is not None:
        return args.kv_reservation_timeout
    return args.request_timeout + args.kv_transfer_timeout + 30.0


def _serve_router(args: argparse.Namespace, model: str, name: str, router_addr: str, procs: list[WorkerProcess]) -> int:
    import uvicorn

    from router.app import RouterConfig, WorkerSpec, create_app
    from router.pd import PDTimeouts

    pd = args.prefill is not None or args.decode is not None
    worker_addrs = (f"tcp://{args.worker_host}:{args.worker_port}",) if args.worker_port is not None else ()
    if worker_addrs and worker_addrs[0].endswith(":0"):
        worker_addrs = (worker_addrs[0][: -len(":0")] + ":*",)  # zmq's wildcard port
    config = RouterConfig(
        model_dir=model,
        served_model_name=name,
        router_addr=router_addr,
        workers=[WorkerSpec(p.spec.worker_id, p.spec.role, p.spec.in_addr, p.pid) for p in procs],
        api_key=args.api_key,
        max_queue=args.max_queue,
        request_timeout=args.request_timeout,
        max_body_bytes=args.max_body_bytes,
        heartbeat_timeout=args.heartbeat_timeout,
        pd=pd,
        worker_addrs=worker_addrs,
        pd_timeouts=PDTimeouts(prefill=args.request_timeout, transfer=args.kv_transfer_timeout,
                               activate=args.kv_transfer_timeout + 5.0),
    )
    app = create_app(config)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=args.host,
            port=args.port,
            log_level=args.uvicorn_log_level,
            timeout_graceful_shutdown=args.shutdown_timeout,
        )
    )
    if pd:
        p = sum(w.spec.role == "prefill" for w in procs)
        workers = f"{p} prefill + {len(procs) - p} decode worker(s)"
    else:
        workers = f"{len(procs)} worker(s)"
    announce = f"rlt-serve: serving {name!r} with {workers} at " + (
        "{base}\n"
        "  OpenAI API: {base}/v1 (completions, chat/completions, models)\n"
        "  health: {base}/health  metrics: {base}/metrics"
    )
    try:
        asyncio.run(_serve(server, app, procs, announce))
    except SystemExit as e:  # uvicorn exits this way when it cannot bind
        return int(e.code or 1)
    return 0 if server.started else 1
