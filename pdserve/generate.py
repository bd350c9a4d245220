"""`pdserve generate`: offline generation for prompts given on the command line, with timings."""
import argparse
import json
import sys

from pdserve.arg_types import int_at_least
from pdserve.engine.args import add_engine_args, check_engine_args, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt texts, generated together in one batch")
    parser.add_argument("--max-tokens", type=int_at_least(1), default=64,
                        help="tokens to generate per prompt (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="(default: %(default)s)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = no top-k (default: %(default)s)")
    parser.add_argument("--request-seed", type=int, default=None,
                        help="sampling seed of every request (default: none, the engine's --seed)")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(parser)


def run(args) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed, ignore_eos=args.ignore_eos)
    check_engine_args(args)
    llm = LLM(**engine_kwargs(args))
    # the generated text in bold, on a terminal only (not in a pipe or a file)
    bold, plain = ("\033[1m", "\033[0m") if sys.stdout.isatty() else ("", "")
    for prompt, out in zip(args.prompts, llm.generate(args.prompts, params)):
        m = out.metrics
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "metrics": m.as_dict()}))
            continue
        tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
        print(f"{prompt}{bold}{out.text}{plain}")
        print(f"  [{len(out.token_ids)} tokens, {out.finish_reason}; TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}, "
              f"e2e {m.e2e * 1e3:.1f} ms]")
    return 0
