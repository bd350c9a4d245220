"""`pdserve generate`: offline generation for prompts given on the command line, with timings."""
import argparse
import json

from pdserve.engine.args import add_engine_args, engine_kwargs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("prompts", nargs="+", help="prompt texts, generated together in one batch")
    parser.add_argument("--max-tokens", type=int, default=64, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--request-seed", type=int, default=None, help="sampling seed of every request")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at EOS")
    parser.add_argument("--json", action="store_true", help="print one JSON object per prompt")
    add_engine_args(parser)


def run(args) -> int:
    from pdserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed, ignore_eos=args.ignore_eos)
    llm = LLM(**engine_kwargs(args))
    for prompt, out in zip(args.prompts, llm.generate(args.prompts, params)):
        m = out.metrics
        if args.json:
            print(json.dumps({"prompt": prompt, "text": out.text, "token_ids": out.token_ids,
                              "finish_reason": out.finish_reason, "metrics": m.as_dict()}))
            continue
        tpot = f"{m.tpot * 1e3:.1f} ms" if m.tpot is not None else "n/a"
        print(f"{prompt}\033[1m{out.text}\033[0m")
        print(f"  [{len(out.token_ids)} tokens, {out.finish_reason}; TTFT {m.ttft * 1e3:.1f} ms, TPOT {tpot}, "
              f"e2e {m.e2e * 1e3:.1f} ms]")
    return 0
