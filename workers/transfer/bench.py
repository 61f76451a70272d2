"""Transfer throughput between two processes, as a PD pair moves KV pages.

    python -m workers.transfer.bench --kind nixl --device cuda --planes 96 --page-kib 32 --chunk-pages 16

A receiver process registers K and V like an engine's pool; the writer pushes chunks of
`--chunk-pages` pages in every plane (the region lists a chunk produces), up to `--window` writes
in flight, and reports GiB/s and per-write latency as one JSON line. The received bytes are
checked against the writer's, so a fast wrong transport cannot pass.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import statistics
import time

import torch

from workers.transfer import KVLayout, TransferNotif, decode_notif, encode_notif, kv_regions, make_agent


def _pool(planes: int, pages: int, page_bytes: int, device: str, fill: bool) -> list[torch.Tensor]:
    shape = (planes, pages, page_bytes // 2)
    if not fill:
        return [torch.zeros(shape, dtype=torch.float16, device=device) for _ in range(2)]
    g = torch.Generator().manual_seed(0)
    return [torch.randn(shape, generator=g).half().to(device) for _ in range(2)]


def _receiver(args: argparse.Namespace, conn) -> None:
    bufs = _pool(args.planes, args.pages, args.page_kib * 1024, args.device, fill=False)
    agent = make_agent(args.kind, "recv", bufs)
    conn.send(agent.metadata())
    agent.add_peer("send", conn.recv())
    done = False
    while not done:
        for _, msg in agent.notifications():
            done |= decode_notif(msg).kind == "finished"
    if args.device == "cuda":
        torch.cuda.synchronize()
    conn.send([b.double().sum().item() for b in bufs])
    agent.close()


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m workers.transfer.bench")
    p.add_argument("--kind", choices=["nixl", "zmq"], default="nixl")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--planes", type=int, default=16)
    p.add_argument("--pages", type=int, default=256)
    p.add_argument("--page-kib", type=int, default=16, help="bytes of one page of one plane, KiB")
    p.add_argument("--chunk-pages", type=int, default=16)
    p.add_argument("--window", type=int, default=4, help="writes in flight")
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args(argv)
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=_receiver, args=(args, child), daemon=True)
    proc.start()
    bufs = _pool(args.planes, args.pages, args.page_kib * 1024, args.device, fill=True)
    agent = make_agent(args.kind, "send", bufs, timeout_s=60)
    agent.add_peer("recv", conn.recv())
    conn.send(agent.metadata())
    layout = KVLayout.of(bufs[0])
    n_chunks = args.pages // args.chunk_pages
    regions = [kv_regions(layout, layout, list(range(c * args.chunk_pages, (c + 1) * args.chunk_pages)),
                          list(range(c * args.chunk_pages, (c + 1) * args.chunk_pages))) for c in range(n_chunks)]
    chunk_bytes = sum(r.nbytes for r in regions[0][0])
    in_flight: dict[int, float] = {}
    latencies: list[float] = []
    i, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < args.seconds or in_flight:
        if len(in_flight) < args.window and time.perf_counter() - t0 < args.seconds:
            src, dst = regions[i % n_chunks]
            in_flight[agent.write("recv", src, dst, encode_notif(TransferNotif("chunk", "bench", 1, i)))] = time.perf_counter()
            i += 1
        for h, start in list(in_flight.items()):
            state = agent.status(h)
            if state != "pending":
                if state == "failed":
                    raise RuntimeError("a benchmark write failed")
                latencies.append(time.perf_counter() - start)
                agent.release(h)
                del in_flight[h]
        agent.notifications()
    elapsed = time.perf_counter() - t0
    agent.notify("recv", encode_notif(TransferNotif("finished", "", 0)))
    want = [b[:, : n_chunks * args.chunk_pages].double().sum().item() for b in bufs]
    got = conn.recv()
    proc.join(30)
    agent.close()
    if i >= n_chunks and any(abs(a - b) > 1e-3 * max(1.0, abs(a)) for a, b in zip(got, want)):
        raise RuntimeError(f"received data differs: {got} vs {want}")
    out = dict(kind=args.kind, device=args.device, chunk_bytes=chunk_bytes, writes=len(latencies),
               regions_per_write=len(regions[0][0]), gib_per_s=round(len(latencies) * chunk_bytes / elapsed / 2**30, 3),
               latency_ms_p50=round(statistics.median(latencies) * 1e3, 3), verified=i >= n_chunks)
    print(json.dumps(out))
    return out


if __name__ == "__main__":
    main()
