"""What reduced precision buys in speed and costs in accuracy, against fp32.

Speed: batch-1 decode TPOT (one 128-token prompt, 32 greedy tokens), the variants interleaved
round by round in one process so that a drift in the machine's bandwidth hits all of them alike.
Accuracy: next-token distributions on a fixed prompt set, teacher-forced (every position of
every prompt, one prefill).

    python -m benchmarks.quant_accuracy --model DIR [--prompts 16 --prompt-len 128 --rounds 5 --variants int8,int4,bf16]

int8: 8-bit codes, an fp32 scale per output channel; int4: 4-bit codes, an fp32 scale and offset per
group of 32 inputs (the lm_head int8); both made at load (--quantization).

Per precision: top-1 agreement with fp32, mean overlap of the top-5 sets, how often fp32's top
token is in the other's top-5 (vLLM's rule for comparing precisions), mean KL(fp32 || other) and
the largest change of fp32's top token's logprob. Writes JSON (default
benchmarks/results/perf/quant_accuracy_<model>.json)."""
import argparse
import json
import os
import sys

import torch

from pdserve import LLM
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams
from tools.make_model import corpus_texts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VARIANTS = {"fp32": {}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"},
            "bf16": {"dtype": "bfloat16"}}


def prompts_from_corpus(tokenizer, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(" ".join(corpus_texts())[:400_000], add_special_tokens=False)
    step = max(length, (len(ids) - length) // n)
    return [ids[i * step:i * step + length] for i in range(n) if len(ids[i * step:i * step + length]) == length]


@torch.no_grad()
def all_logprobs(llm: LLM, prompt: list[int]) -> torch.Tensor:
    """Log-softmax at every position of `prompt`, from one prefill through the engine's runner."""
    engine = llm.engine
    seq = Sequence("probe", prompt, SamplingParams(), 0.0)
    seq.prefill_len = len(prompt)
    engine.block_manager.allocate(seq, len(prompt))
    try:
        sched = SchedulerOutput()
        sched.add(seq, len(prompt))
        return torch.log_softmax(engine.runner.forward_logits(sched), dim=-1)
    finally:
        engine.block_manager.free(seq)


def compare(ref: torch.Tensor, other: torch.Tensor) -> dict:
    """ref, other: (positions, vocab) logprobs."""
    top_ref, top_oth = ref.topk(5, dim=-1).indices, other.topk(5, dim=-1).indices
    overlap = (top_ref[:, :, None] == top_oth[:, None, :]).any(-1).float().sum(-1) / 5
    best = top_ref[:, 0]
    kl = (ref.exp() * (ref - other)).sum(-1)
    return {"positions": ref.shape[0],
            "top1_agreement": (best == top_oth[:, 0]).float().mean().item(),
            "top5_overlap": overlap.mean().item(),
            "ref_top1_in_top5": (top_oth == best[:, None]).any(-1).float().mean().item(),
            "mean_kl": kl.mean().item(),
            "max_top1_logprob_change": (ref.gather(1, best[:, None]) - other.gather(1, best[:, None])).abs().max().item()}


def decode_speed(llms: dict[str, LLM], rounds: int) -> dict[str, float]:
    """Median batch-1 decode TPOT (seconds) per variant, measured in interleaved rounds."""
    params = SamplingParams(max_tokens=32, temperature=0, ignore_eos=True)
    prompt = list(range(10, 138))
    for llm in llms.values():   # warm-up
        llm.generate([prompt], params)
    tpots = {name: [] for name in llms}
    for _ in range(rounds):
        for name, llm in llms.items():
            tpots[name].append(llm.generate([prompt], params)[0].metrics.tpot)
    return {name: sorted(v)[len(v) // 2] for name, v in tpots.items()}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=os.path.join(REPO, "pdserve", "data", "default-model"))
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=128)
    p.add_argument("--variants", default="int8,int4,bf16", help=f"comma-separated, of {', '.join(VARIANTS)}")
    p.add_argument("--rounds", type=int, default=5, help="interleaved speed rounds (0: skip the speed part)")
    p.add_argument("--output", default=None)
    args = p.parse_args(argv)
    ref_llm = LLM(args.model)
    prompts = prompts_from_corpus(ref_llm.tokenizer, args.prompts, args.prompt_len)
    ref = [all_logprobs(ref_llm, pr) for pr in prompts]
    del ref_llm
    ref = torch.cat(ref)
    results = {"model": args.model, "prompts": len(prompts), "prompt_len": args.prompt_len, "against": "fp32"}
    variants = args.variants.split(",")
    if args.rounds:
        llms = {name: LLM(args.model, num_kv_blocks=64, **VARIANTS[name]) for name in ["fp32", *variants]}
        tpot = decode_speed(llms, args.rounds)
        del llms
        results["decode_tpot_ms"] = {name: 1e3 * t for name, t in tpot.items()}
        results["decode_speedup_vs_fp32"] = {name: tpot["fp32"] / t for name, t in tpot.items()}
        print("batch-1 decode TPOT (median of %d interleaved rounds): " % args.rounds
              + ", ".join(f"{n} {1e3 * t:.1f} ms ({tpot['fp32'] / t:.2f}x fp32)" for n, t in tpot.items()))
    for name in variants:
        llm = LLM(args.model, **VARIANTS[name])
        results[name] = compare(ref, torch.cat([all_logprobs(llm, pr) for pr in prompts]))
        del llm
        r = results[name]
        print(f"{name}: top-1 agreement {100 * r['top1_agreement']:.2f}%, top-5 overlap {100 * r['top5_overlap']:.2f}%, "
              f"fp32 top-1 in top-5 {100 * r['ref_top1_in_top5']:.2f}%, mean KL {r['mean_kl']:.2e}, "
              f"max top-1 logprob change {r['max_top1_logprob_change']:.3f} ({r['positions']} positions)")
    name = os.path.basename(os.path.normpath(args.model))
    out = args.output or os.path.join(REPO, "benchmarks", "results", "perf", f"quant_accuracy_{name}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(results, f, indent=2)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
