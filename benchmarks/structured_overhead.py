"""Constrained decoding's cost per decode step, side by side with unconstrained steps.

    python -m benchmarks.structured_overhead MODEL_DIR [--batch 1 32] [--steps 24]

For each batch size: B greedy requests without a constraint (the fused-argmax path when the
model has it), B sampled ones (temperature 1: the logits path), and B greedy ones constrained by
a typical schema (an object of 5 fields with a nested array). Reports the mean decode step while
all B run, and the constrained step's extra time against each. Prints one JSON line per batch."""
import argparse
import json
import time

from pdserve.engine.grammar import GrammarSpec
from pdserve.engine.llm_engine import LLMEngine
from pdserve.sampling_params import SamplingParams

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string"}, "age": {"type": "integer"}, "email": {"type": "string"},
    "active": {"type": "boolean"},
    "tags": {"type": "array", "items": {"type": "object", "properties": {"k": {"type": "string"},
                                                                       "v": {"type": "number"}},
                                        "required": ["k", "v"]}}},
    "required": ["name", "age", "email", "active", "tags"]}
PROMPT = "Describe a person as JSON with their name, age, email, whether they are active, and tags:"


def decode_steps(engine: LLMEngine, batch: int, params: SamplingParams, steps: int, tag: str) -> list[float]:
    """Durations of the decode steps while all `batch` requests run (prefill steps left out)."""
    for i in range(batch):
        engine.add_request(f"{tag}-{i}", PROMPT, params)
    times = []
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        s = engine.last_step
        if s is not None and s.num_prefill_tokens == 0 and s.num_seqs == batch and len(times) < steps:
            times.append(dt)
        if len(times) >= steps or any(o.finished for o in outs):
            for i in range(batch):
                engine.abort_request(f"{tag}-{i}")
    while engine.has_unfinished_requests():
        engine.step()
    return times


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32])
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--dtype", default="auto")
    args = ap.parse_args(argv)
    engine = LLMEngine(args.model, dtype=args.dtype, max_num_seqs=max(args.batch), max_model_len=1024)
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    engine.processor.grammars.check(spec)   # the compile (cached) is not part of a step
    kinds = {"greedy": SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
             "sampled": SamplingParams(max_tokens=200, temperature=1.0, seed=0, ignore_eos=True),
             "constrained": SamplingParams(max_tokens=200, temperature=0, grammar=spec)}
    for b in args.batch:
        decode_steps(engine, b, kinds["greedy"], 4, "warmup")
        res = {"batch": b}
        for name, params in kinds.items():
            t = decode_steps(engine, b, params, args.steps, name)
            res[f"{name}_ms"] = round(1e3 * sum(t) / len(t), 2) if t else None
            res[f"{name}_steps"] = len(t)
        for base in ("greedy", "sampled"):
            if res[f"{base}_ms"] and res["constrained_ms"]:
                res[f"overhead_vs_{base}"] = round(res["constrained_ms"] / res[f"{base}_ms"] - 1, 3)
        print(json.dumps(res), flush=True)


if __name__ == "__main__":
    main()
