"""The `rlt-serve` command line: build the demo model, generate offline, serve, join as a worker."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any

from rlt_serve.sampling_params import SamplingParams


def _model_or_demo(model: str | None) -> str:
    if model:
        return model
    from rlt_serve.demo import ensure_demo

    return ensure_demo()


def cmd_make_demo(args: argparse.Namespace) -> int:
    from rlt_serve.demo import make_demo

    print(make_demo(args.dir, seed=args.seed))
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from rlt_serve import LLM

    llm = LLM(model=_model_or_demo(args.model), dtype=args.dtype, device=args.device)
    params = SamplingParams(
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        num_loops=args.num_loops,
    )
    prompts = args.prompt or ["Once upon a time"]
    if args.chat:
        outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outs):
        c = out.outputs[0]
        print(json.dumps({"prompt": prompt, "text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    return 0


def cmd_make_random_checkpoint(args: argparse.Namespace) -> int:
    from rlt_serve.testing import SHAPES, write_random_checkpoint

    t0 = time.perf_counter()
    if args.source is not None:
        from rlt_serve.testing import derive_update_scaled

        if args.update_scale is None:
            print("--from needs --update-scale", file=sys.stderr)
            return 2
        derive_update_scaled(args.source, args.dir, args.update_scale)
        print(f"{args.dir}: {args.source} with update scale {args.update_scale} in {time.perf_counter() - t0:.1f}s")
        return 0
    if args.shape is None:
        print("--shape is required (unless --from)", file=sys.stderr)
        return 2
    family, overrides = SHAPES[args.shape]
    write_random_checkpoint(args.dir, family, seed=args.seed, dtype=args.dtype,
                            max_shard_bytes=args.max_shard_bytes, update_scale=args.update_scale,
                            **overrides)  # fmt: skip
    scale = f", update scale {args.update_scale}" if args.update_scale is not None else ""
    print(f"{args.dir}: random {args.shape} ({family}, {args.dtype}{scale}) in {time.perf_counter() - t0:.1f}s")
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from rlt_serve.bench import BenchConfig, bench

    fields = {k: v for k, v in vars(args).items() if k in BenchConfig.__dataclass_fields__}
    result = bench(BenchConfig(reference=not args.skip_reference, **fields))
    print(result["table"])
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({k: v for k, v in result.items() if k != "table"}, f, indent=2)
    return 0


def _add_tools(sub: Any) -> None:
    """make-random-checkpoint and bench: measure serving speed with nothing downloaded."""
    from rlt_serve.bench import H200_BANDWIDTH, H200_BF16_FLOPS
    from rlt_serve.config import ATTENTION_BACKENDS, KV_CACHE_DTYPES
    from rlt_serve.testing import SHAPES

    rnd = sub.add_parser("make-random-checkpoint", help="write a full-size random-weight checkpoint to DIR")
    rnd.add_argument("dir")
    rnd.add_argument("--shape", default=None, choices=sorted(SHAPES), help="required unless --from")
    rnd.add_argument("--dtype", default="bfloat16")
    rnd.add_argument("--seed", type=int, default=0)
    rnd.add_argument("--max-shard-bytes", type=int, default=2 << 30, help="memory peaks at about one shard")
    rnd.add_argument("--update-scale", type=float, default=None,
                     help="scale every layer's residual update, so shallow and deep predictions agree more "
                          "(speculation and early-exit benchmarks; see recipes/spec_exit.md)")
    rnd.add_argument("--from", dest="source", default=None,
                     help="with --update-scale: derive from this sharded random checkpoint, symlinking its "
                          "shards and rewriting only the update tensors (seconds instead of minutes)")
    rnd.set_defaults(func=cmd_make_random_checkpoint)

    b = sub.add_parser("bench", help="offline throughput/latency against the DESIGN §5 floors")
    b.add_argument("--model", required=True, help="local checkpoint directory (see make-random-checkpoint)")
    b.add_argument("--concurrency", type=int, default=1)
    b.add_argument("--num-prompts", type=int, default=None, help="default: --concurrency")
    b.add_argument("--input-len", type=int, default=512)
    b.add_argument("--output-len", type=int, default=128)
    b.add_argument("--runs", type=int, default=3, help="measured runs (the table shows the median)")
    b.add_argument("--warmup", type=int, default=1, help="unmeasured runs first")
    b.add_argument("--attention-backend", default="auto", choices=ATTENTION_BACKENDS)
    b.add_argument("--kv-cache-dtype", default="auto", choices=list(KV_CACHE_DTYPES),
                   help="K/V storage: the model dtype, or fp8 (e4m3; or fp8_e5m2) at half the bytes")
    b.add_argument("--dtype", default="auto")
    b.add_argument("--device", default="auto")
    b.add_argument("--max-num-batched-tokens", type=int, default=8192)
    b.add_argument("--long-prefill-token-threshold", type=int, default=2048)
    b.add_argument("--num-kv-pages", type=int, default=None)
    b.add_argument("--num-loops", type=int, default=None)
    b.add_argument("--skip-reference", action="store_true", help="skip the dense recompute reference at c=1")
    b.add_argument("--reference-runs", type=int, default=1)
    b.add_argument("--seed", type=int, default=0)
    b.add_argument("--peak-flops", type=float, default=H200_BF16_FLOPS)
    b.add_argument("--peak-bandwidth", type=float, default=H200_BANDWIDTH)
    b.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (vLLM's flag)")
    b.add_argument("--async-scheduling", action="store_true",
                   help="launch each step before reading the previous step's tokens (vLLM's flag)")
    b.add_argument("--prefill-tokens", type=int, default=0,
                   help="also time one prompt batch of at least this many tokens (prefill FLOP rate)")
    b.add_argument("--json", default=None, help="also write the measurements as JSON here")
    b.add_argument("--num-speculative-tokens", type=int, default=0, help="self-speculation: drafts per round")
    b.add_argument("--speculative-draft-depth", type=int, default=1, help="loops a draft runs")
    b.add_argument("--speculative-adaptive", action="store_true", help="choose K and draft depth online")
    b.add_argument("--exit-threshold", type=float, default=None, help="Ouro Q-exit threshold (< 1: early exit)")
    b.add_argument("--baseline", action="store_true", help="also run plain decoding and report the speedup")
    b.set_defaults(func=cmd_bench)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rlt-serve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    demo = sub.add_parser("make-demo", help="write the built-in tiny random Ouro checkpoint to DIR")
    demo.add_argument("dir")
    demo.add_argument("--seed", type=int, default=0)
    demo.set_defaults(func=cmd_make_demo)

    gen = sub.add_parser("generate", help="offline generation (the demo model when --model is not given)")
    gen.add_argument("--model", default=None, help="local Hugging Face-format checkpoint directory")
    gen.add_argument("--prompt", action="append", help="may be repeated")
    gen.add_argument("--chat", action="store_true", help="wrap each prompt as a user message and apply the chat template")
    gen.add_argument("--max-tokens", type=int, default=32)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--num-loops", type=int, default=None)
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.set_defaults(func=cmd_generate)
    _add_tools(sub)

    from router import launch

    serve = sub.add_parser("launch", help="serve the OpenAI-compatible API: router plus worker processes")
    launch.add_arguments(serve)
    serve.set_defaults(func=launch.run)

    from workers import join

    w = sub.add_parser("worker", help="one worker process that joins a running router (--router tcp://HOST:PORT)")
    join.add_arguments(w)
    w.set_defaults(func=join.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
