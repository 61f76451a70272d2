"""The `rlt-serve` command line: build the demo model, generate offline."""

from __future__ import annotations

import argparse
import json
import sys

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
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
