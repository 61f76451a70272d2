"""`rlt-serve worker`: one worker process that joins a running router from anywhere it can reach.

    rlt-serve worker --role decode --router tcp://ROUTER_HOST:PORT --model DIR

The router must listen for workers (`rlt-serve launch ... --worker-port PORT`). The worker binds
its own inbox on a TCP port (`--listen`, a free port by default), tells the router where to reach
it in its Ready message, and from then on is indistinguishable from a launched worker: it gets a
warm-up request, then traffic; it appears in /health and /metrics; if it dies, only its requests
fail. This is how the prefill and decode pods of a deployment form one service (see deploy/).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import zlib


def add_arguments(p: argparse.ArgumentParser) -> None:
    from router.launch import add_engine_arguments

    p.add_argument("--role", required=True, choices=["prefill", "decode", "both"])
    p.add_argument("--router", required=True, help="the router's worker endpoint, tcp://HOST:PORT")
    p.add_argument("--model", required=True, help="checkpoint directory (the same model the router serves)")
    p.add_argument("--worker-id", default=None, help="unique name (default: ROLE-HOSTNAME-PID)")
    p.add_argument("--listen", default="tcp://0.0.0.0:0", help="where this worker's inbox binds (port 0: free)")
    p.add_argument("--advertise-host", default=None, help="host the router dials back (default: the local "
                   "address on the route to the router)")  # fmt: skip
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-transport", default="nixl", choices=["nixl", "zmq"])
    p.add_argument("--kv-transfer-timeout", type=float, default=30.0)
    p.add_argument("--kv-transfer-budget-bytes", type=int, default=256 << 20)
    p.add_argument("--kv-reservation-timeout", type=float, default=None,
                   help="decode: seconds a reservation may wait for activation (default 660; keep it past the "
                        "router's request timeout)")  # fmt: skip
    p.add_argument("--drain-timeout", type=float, default=30.0)
    add_engine_arguments(p)


def run(args: argparse.Namespace) -> int:
    from router.launch import engine_args
    from workers import worker

    if not args.router.startswith("tcp://"):
        print(f"rlt-serve worker: --router must be tcp://HOST:PORT, got {args.router!r}", flush=True)
        return 2
    wid = args.worker_id or f"{args.role}-{socket.gethostname()}-{os.getpid()}"
    eng = engine_args(args)
    # Without --seed each pod still draws its own seeds for unseeded requests (see worker_engine_args).
    eng.setdefault("seed", zlib.crc32(wid.encode()))
    argv = [
        "--worker-id", wid, "--role", args.role, "--model", args.model, "--in-addr", args.listen,
        "--out-addr", args.router, "--join", "--device", args.device, "--dtype", args.dtype,
        "--engine-args", json.dumps(eng), "--drain-timeout", str(args.drain_timeout),
        "--kv-transport", args.kv_transport, "--kv-transfer-timeout", str(args.kv_transfer_timeout),
        "--kv-transfer-budget-bytes", str(args.kv_transfer_budget_bytes),
    ]  # fmt: skip
    if args.advertise_host:
        argv += ["--advertise-host", args.advertise_host]
    if args.kv_reservation_timeout is not None:
        argv += ["--kv-reservation-timeout", str(args.kv_reservation_timeout)]
    return worker.main(argv)
