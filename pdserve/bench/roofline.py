"""`pdserve roofline`: this machine's limits, and the engine's own forward measured against them.

It measures the two roofs (memory read bandwidth, matrix-multiply peak per dtype; see
machine_limits.py), then drives the engine's ModelRunner with hand-built steps: prefills of one
prompt, decodes of B sequences at context C (one new token each against a filled cache), and the
`nocache` decode that re-runs the whole sequence for one token. Every step's FLOPs and bytes are
counted from the model config, so each point has an arithmetic intensity (FLOP per byte moved),
a roof min(peak, AI x bandwidth) and the fraction of it reached. That shows, measured, what the
design rests on: prefill is compute-bound, decode is memory-bound, batching decodes amortizes the
weight read but not the KV read, and decoding without a cache costs a prefill per token."""
import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, replace

import torch

from pdserve.bench.roofline_report import experts_finding, findings, plot, print_table, record
from pdserve.bench.step_cost import ModelCost, StepCost, phase_steps, step_cost
from pdserve.config import ModelConfig
from pdserve.arg_types import int_at_least
from pdserve.engine.args import add_engine_args, engine_kwargs
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.sampling_params import SamplingParams

QUICK = dict(prefill_lens=[32, 128, 512], decode_batches=[1, 4, 16], decode_contexts=[128, 512], repeats=2)
FULL = dict(prefill_lens=[16, 32, 64, 128, 256, 512, 1024, 2048], decode_batches=[1, 2, 4, 8, 16, 32, 64],
            decode_contexts=[128, 256, 512, 1024, 2048], repeats=3)
OVERHEAD_STEPS = 5


# --- measuring the engine's forward -------------------------------------------------------------

def held_bytes_per_weight(model: torch.nn.Module) -> dict[str, float]:
    """Bytes per weight of the layers' linears, the lm_head and the routed experts as the model holds
    them, i.e. as a step reads them: a packed or group-quantized linear's codes plus its scales and
    offsets (int8, int4, a GGUF file's or a Hub checkpoint's codes), a torch linear's weight. A
    part the model lacks is 0."""
    from pdserve.layers.moe import FusedMoE
    held = {"linear": [0, 0], "lm_head": [0, 0], "experts": [0, 0]}
    for name, m in model.named_modules():
        if isinstance(m, FusedMoE):
            # the stacked experts in whatever form they are held: dense, int8 codes + scales
            # (--quantization int8), MXFP4 blocks + scales
            held["experts"][0] += sum(p.nbytes for p in m.held_weights())
            held["experts"][1] += 3 * m.num_experts * m.intermediate_size * m.hidden_size
        elif hasattr(m, "in_features") and hasattr(m, "out_features"):
            tensors = [m.weight] if isinstance(m, torch.nn.Linear) else \
                [b for n, b in m.named_buffers(recurse=False) if n in ("packed", "scale", "offset")]
            part = held["lm_head" if name == "lm_head" else "linear"]
            part[0] += sum(t.nbytes for t in tensors)
            part[1] += m.in_features * m.out_features
    return {k: b / n if n else 0.0 for k, (b, n) in held.items()}


def held_cost(engine) -> tuple[ModelCost, dict[str, float]]:
    """The engine's model cost with its weights' bytes as held (held_bytes_per_weight), and those bytes."""
    held = held_bytes_per_weight(engine.runner.model)
    return replace(ModelCost.from_config(engine.model_config, engine.runner.dtype.itemsize),
                   weight_itemsize=held["linear"], lm_head_itemsize=held["lm_head"],
                   expert_itemsize=held["experts"]), held


class ExpertCounter:
    """Counts the routed experts each forward selects, summed over the MoE layers: forward hooks on
    the routers, whose (weights, ids) output names each token's experts."""

    def __init__(self, model: torch.nn.Module):
        from pdserve.layers.moe import Router
        self.count = 0
        self.handles = [m.register_forward_hook(self.hook) for m in model.modules() if isinstance(m, Router)]

    def hook(self, module, inputs, output):
        self.count += int(output[1].unique().numel())

    def close(self):
        for h in self.handles:
            h.remove()


def time_step(engine, seqs: list[tuple[int, int]], ids: list[int], repeats: int,
              experts: ExpertCounter | None = None) -> tuple[list[float], list[float]]:
    """Run one hand-built step (after a warm-up) and return its forward times and its whole
    runner.execute times (with input preparation and sampling). experts: counts the last run's
    routed experts (the same step each run)."""
    bm, runner = engine.block_manager, engine.runner
    sched, params = SchedulerOutput(), SamplingParams(temperature=0)
    forward, execute = [], []
    try:
        for i, (q, c) in enumerate(seqs):
            # each its own tokens (a mixture of experts routes them apart, as real requests)
            seq = Sequence(f"roofline-{i}", ids[i:i + c], params, 0.0)
            # Pretend the first c - q tokens are cached: only positions and lengths matter for timing.
            seq.num_computed_tokens = c - q
            seq.prefill_len = c if q > 1 else c - 1
            bm.allocate(seq, c)
            sched.add(seq, q)
        for r in range(repeats + 1):
            if experts is not None:
                experts.count = 0
            t0 = time.perf_counter()
            runner.execute(sched)
            if r:
                execute.append(time.perf_counter() - t0)
                forward.append(runner.last_forward_time)
    finally:
        for seq in sched.seqs:
            bm.free(seq)
    return forward, execute


def overhead_max_tokens(batch: int, context: int, budget: int, steps: int = OVERHEAD_STEPS,
                        prefill_cap: int = 0) -> int:
    """Tokens each overhead request may generate: enough that none finishes before the timed steps end.
    The prefills take at most ceil(batch x context / per_step) + 1 steps, decoding the early
    requests meanwhile; per_step is budget - batch, or less under the decode-aware prefill cap."""
    per_step = min(prefill_cap, budget - batch) if prefill_cap else budget - batch
    return -(-batch * context // per_step) + 1 + steps + 2


def engine_overhead(engine, batch: int, context: int, ids: list[int], steps: int = OVERHEAD_STEPS,
                    final_only: bool = False) -> dict:
    """Whole engine.step() (schedule, prepare, forward, sample, detokenize, outputs) against the
    runner's forward, for a decode batch of real requests: streamed (an output per request and
    step), or final_only (LLM.generate's and non-streamed responses' requests)."""
    max_tokens = overhead_max_tokens(batch, context, engine.config.max_num_batched_tokens, steps,
                                     engine.config.max_prefill_tokens_with_decodes)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, final_only=final_only)
    rids = [f"roofline-overhead-{i}" for i in range(batch)]
    for rid in rids:
        engine.add_request(rid, ids[:context], params)
    while engine.scheduler.waiting or any(s.is_prefill for s in engine.scheduler.running):
        engine.step()   # the prefills, under the engine's own token budget
    engine.step()       # warm-up decode
    step_t, forward_t, outputs = [], [], 0
    for _ in range(steps):
        t0 = time.perf_counter()
        outputs += len(engine.step())
        step_t.append(time.perf_counter() - t0)
        forward_t.append(engine.runner.last_forward_time)
        s = engine.last_step
        if s.num_prefill_tokens or s.num_decode_tokens != batch:
            raise RuntimeError(f"overhead step was not a pure decode of {batch}: {s}")
    for rid in rids:
        engine.abort_request(rid)
    engine.step()
    engine.block_manager.check_all_free()
    step, forward = statistics.median(step_t), statistics.median(forward_t)
    return dict(batch=batch, context=context, steps=steps, final_only=final_only, outputs_per_step=outputs / steps,
                step_ms=step * 1e3, forward_ms=forward * 1e3,
                overhead_ms=(step - forward) * 1e3, overhead_pct=100 * (step - forward) / step)


def side_by_side_read(engine, steps: dict[int, tuple[StepCost, list[tuple[int, int]]]], ids: list[int],
                      read_bytes: int, rounds: int) -> dict:
    """Small-batch decode steps against the time to read their bytes at the bandwidth probed just
    before them, round after round. This VM's bandwidth drifts by 1.6x within minutes
    (docs/PERFORMANCE.md): a roof probed minutes away from a step says little about its ratio to it.
    steps: batch -> (its cost, its sequences)."""
    from pdserve.bench import machine_limits
    x = machine_limits.probe_array(read_bytes)
    threads, bws = torch.get_num_threads(), []
    out = {b: dict(bytes=cost.bytes, step_s=[], ratio=[]) for b, (cost, _) in steps.items()}
    for _ in range(rounds):
        bw = max(machine_limits.read_bandwidth(x, threads, 2), machine_limits.kernel_gemv_bandwidth(x, 2))
        bws.append(bw)
        for b, (cost, seqs) in steps.items():
            t = statistics.median(time_step(engine, seqs, ids, 3)[0])
            out[b]["step_s"].append(t)
            out[b]["ratio"].append(t / (cost.bytes / bw))
    for r in out.values():
        r["ratio_median"] = statistics.median(r["ratio"])
    context = next(iter(steps.values()))[1][0][1]
    return dict(context=context, rounds=rounds, bandwidth=bws, batches={str(b): r for b, r in out.items()})


def side_by_side_peak(engine, steps: dict[str, tuple[StepCost, list[tuple[int, int]]]], ids: list[int],
                      dtype: str, gemm_n: int, rounds: int) -> dict:
    """Compute-bound steps against the GEMM peak probed just before them, round after round: the
    compute-side twin of side_by_side_read. A neighbour that takes a core for a minute slows the
    probe and the steps of that round alike, where a peak probed minutes away (the sweep's best
    of before and after) would count it against the steps alone. steps: name -> (cost, sequences)."""
    from pdserve.bench import machine_limits

    def peak() -> float:
        torch_peak = machine_limits.gemm_flops(gemm_n, machine_limits.DTYPES[dtype], 2)
        return max(torch_peak, machine_limits.kernel_gemm_flops(gemm_n, 2)) if dtype == "float32" else torch_peak

    peaks = []
    out = {name: dict(flops=cost.flops, step_s=[], fraction=[]) for name, (cost, _) in steps.items()}
    for _ in range(rounds):
        p = peak()
        peaks.append(p)
        for name, (cost, seqs) in steps.items():
            t = statistics.median(time_step(engine, seqs, ids, 1)[0])
            out[name]["step_s"].append(t)
            out[name]["fraction"].append(cost.flops / t / p)
    for r in out.values():
        r["fraction_median"] = statistics.median(r["fraction"])
    return dict(rounds=rounds, gemm_n=gemm_n, peak_flops=peaks, steps=out)


# --- the command ----------------------------------------------------------------------------------

def int_list(s: str) -> list[int]:
    return [int(v) for v in s.split(",") if v]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true",
                        help=f"few small points and smaller probes (prefill {QUICK['prefill_lens']}, decode batches "
                             f"{QUICK['decode_batches']} x contexts {QUICK['decode_contexts']})")
    parser.add_argument("--repeats", type=int, default=None, help="timed runs per point after a warm-up "
                        f"(default {FULL['repeats']}, quick {QUICK['repeats']}); the median is reported")
    parser.add_argument("--prefill-lens", type=int_list, default=None, help="comma-separated prompt lengths")
    parser.add_argument("--decode-batches", type=int_list, default=None, help="comma-separated decode batch sizes")
    parser.add_argument("--decode-contexts", type=int_list, default=None,
                        help="comma-separated decode context lengths (also the nocache points)")
    parser.add_argument("--overhead-batch", type=int, default=8, help="decode batch for the engine overhead")
    parser.add_argument("--overhead-steps", type=int_at_least(1), default=OVERHEAD_STEPS,
                        help=f"decode steps timed for the engine overhead, the median reported (default "
                             f"{OVERHEAD_STEPS}; a tiny model's steps take milliseconds and vary: give it 64 or more)")
    parser.add_argument("--read-rounds", type=int, default=6,
                        help="rounds of (read probe, decode steps of batch 1 and 4) side by side at the smallest "
                             "decode context: each step's ratio to the time to read its bytes (0: skip)")
    parser.add_argument("--peak-rounds", type=int, default=0,
                        help="rounds of (GEMM probe, the compute-bound steps: every prefill length and the decode "
                             "batches past the ridge at the smallest decode context) side by side: each step's "
                             "fraction of the peak probed right before it (default 0: skip)")
    parser.add_argument("--cost-model", action="store_true",
                        help="only fit and print the step-time model the slo scheduling policy uses (seconds; "
                             "the engine flags shape it: --max-num-batched-tokens, --max-num-seqs)")
    parser.add_argument("--output", default=None, help="write all measurements as JSON to this file")
    parser.add_argument("--plot", default=None, help="write the roofline plot (PNG) to this file")
    add_engine_args(parser)


def plan(args, kwargs: dict, limit: int) -> tuple[list[tuple[str, int, int]], tuple[int, int, int]]:
    """The measured points (phase, batch, context) within the model's context, and the overhead
    run (batch, prompt length, max tokens). Sizes the KV cache for the largest of them unless the
    user did: points run one at a time."""
    preset = QUICK if args.quick else FULL
    asked_prefill = args.prefill_lens or preset["prefill_lens"]
    asked_contexts = args.decode_contexts or preset["decode_contexts"]
    prefill, contexts = [n for n in asked_prefill if n <= limit], [c for c in asked_contexts if c <= limit]
    batches = args.decode_batches or preset["decode_batches"]
    if len(prefill + contexts) < len(asked_prefill + asked_contexts):
        print(f"skipped lengths beyond the model's context of {limit} tokens")
    points = [("prefill", 1, n) for n in prefill] + [("decode", b, c) for c in contexts for b in batches] + \
             [("nocache", 1, c) for c in contexts]
    # The overhead run: real requests at the smallest decode context, prefilled by the engine itself.
    budget = kwargs["max_num_batched_tokens"]
    ob = max(1, min(args.overhead_batch, kwargs["max_num_seqs"], budget // 2))
    oc = min(contexts or prefill or [16])
    cap = kwargs.get("max_prefill_tokens_with_decodes", 0)
    steps = args.overhead_steps
    while oc > 1 and oc + overhead_max_tokens(ob, oc, budget, steps, cap) > limit:
        oc //= 2
    om = overhead_max_tokens(ob, oc, budget, steps, cap)
    if kwargs["num_kv_blocks"] is None and kwargs["kv_cache_memory"] is None:
        bs = kwargs["block_size"]
        kwargs["num_kv_blocks"] = max([ob * -(-(oc + om) // bs)] + [b * -(-c // bs) for _, b, c in points])
    return points, (ob, oc, om)


def run(args) -> int:
    from pdserve.bench import machine_limits
    from pdserve.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    if (kwargs["device"] or "cpu") != "cpu":
        print("pdserve roofline: error: the machine probes measure the CPU; run it with --device cpu")
        return 2
    torch.set_num_threads(args.threads or len(os.sched_getaffinity(0)))   # the probes' threads are the engine's
    if args.cost_model:
        return print_cost_model(args, kwargs)
    repeats = args.repeats or (QUICK if args.quick else FULL)["repeats"]
    cfg = ModelConfig.from_dir(args.model)
    limit = min(args.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
    points, (ob, oc, om) = plan(args, kwargs, limit)

    print(f"machine: {machine_limits.cpu_name()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)")
    engine = LLMEngine(**kwargs)
    print(f"backend: {engine.runner.backend.describe()}")
    dtype = str(engine.runner.dtype).removeprefix("torch.")
    probe_args = (args.quick, ["float32", "bfloat16", dtype], max(repeats, 3))
    limits = machine_limits.measure(*probe_args)

    mc, held = held_cost(engine)
    print("weights as held (what a step reads): " + ", ".join(
        f"{k} {8 * v:.2f} bits/weight" for k, v in held.items() if v))
    # a mixture of experts: each point's expert reads counted from its routers (the step's own routing)
    experts = ExpertCounter(engine.runner.model) if mc.moe_layers else None
    vocab = min(engine.model_config.vocab_size, engine.tokenizer.vocab_size)
    ids = torch.randint(vocab, (max([oc] + [c for _, _, c in points]) + max([b for _, b, _ in points] + [1]),),
                        generator=torch.Generator().manual_seed(0)).tolist()
    bm, timed, measured, expert_reads = engine.block_manager, {}, [], []
    for phase, b, c in points:
        seqs, rows = phase_steps(phase, b, c)
        if b * -(-c // bm.block_size) > bm.num_blocks:
            print(f"  {phase} batch {b} context {c}: skipped, needs more KV blocks than the cache has")
            continue
        # a nocache step is the very step of a prefill of the same length: time it once
        key = (tuple(seqs), rows)
        if key not in timed:
            timed[key] = *time_step(engine, seqs, ids, repeats, experts), experts and experts.count
            print(f"  {phase} batch {b} context {c}: {statistics.median(timed[key][0]) * 1e3:.2f} ms",
                  file=sys.stderr, flush=True)
        forward, execute, counted = timed[key]
        measured.append((phase, b, c, step_cost(mc, seqs, rows, counted), rows, forward, execute))
        if experts is not None:
            expert_reads.append(dict(phase=phase, batch=b, context=c, counted=counted,
                                     expected=mc.experts_read(sum(q for q, _ in seqs))))
    if experts is not None:
        experts.close()
    read = None
    # the memory-bound decode points (batch 1 and 4) at the smallest decode context
    small = sorted((c, b) for phase, b, c in points if phase == "decode" and b <= 4)
    if args.read_rounds and small:
        context, steps = small[0][0], {}
        for b in (b for c, b in small if c == context):
            seqs, rows = phase_steps("decode", b, context)
            steps[b] = (next(m[3] for m in measured if m[:3] == ("decode", b, context)), seqs)
        read = side_by_side_read(engine, steps, ids, limits.read_bytes, args.read_rounds)
    peak_rounds = None
    if args.peak_rounds:
        # compute-bound by the roofs probed before the sweep: prefill, and decode past the ridge
        ridge = limits.peak_flops(dtype) / limits.bandwidth
        steps, dec = {}, sorted(c for phase, _, c in points if phase == "decode")
        for phase, b, c, cost, _, *_ in measured:
            if phase == "prefill" or (phase == "decode" and c == dec[0] and cost.flops / cost.bytes >= ridge):
                steps[f"{phase} batch {b} context {c}"] = (cost, phase_steps(phase, b, c)[0])
        if steps:
            peak_rounds = side_by_side_peak(engine, steps, ids, dtype, limits.gemm_n, args.peak_rounds) | dict(ridge=ridge)
    overhead = overhead_final = None
    if ob * -(-(oc + om) // bm.block_size) <= bm.num_blocks:
        overhead = engine_overhead(engine, ob, oc, ids, args.overhead_steps)
        overhead_final = engine_overhead(engine, ob, oc, ids, args.overhead_steps, final_only=True)
    else:
        print(f"  engine overhead: skipped, {ob} requests of {oc} + {om} tokens do not fit the KV cache")

    # Probe again after the points: on a shared machine a roof is the best of both.
    limits = limits.best_of(machine_limits.measure(*probe_args))
    peak, bw = limits.peak_flops(dtype), limits.bandwidth
    print(f"roofs (best of before and after): {bw / 1e9:.1f} GB/s, {dtype} {peak / 1e9:.1f} GFLOP/s, "
          f"ridge {peak / bw:.1f} FLOP/B")
    recs = [record(*m, peak, bw) for m in measured]
    print_table(recs)
    notes = findings(recs, peak, bw, dtype, overhead, read, overhead_final, peak_rounds)
    if expert_reads:
        notes.insert(0, experts_finding(mc, expert_reads))
    print("\nfindings (on a shared machine times are noisy):")
    for line in notes:
        print(f"  - {line}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(dict(machine=limits.to_dict(),
                           model=dict(path=args.model, architecture=engine.model_config.architecture, dtype=dtype,
                                      cost=asdict(mc), kv_bytes_per_token=mc.kv_bytes_per_token),
                           roof=dict(bandwidth=bw, peak_flops=peak, ridge=peak / bw),
                           points=recs, overhead=overhead, overhead_final_only=overhead_final,
                           side_by_side_read=read, side_by_side_peak=peak_rounds, findings=notes,
                           weights_held_bytes_per_weight=held, expert_reads=expert_reads or None), f, indent=1)
        print(f"wrote {args.output}")
    if args.plot:
        plot(args.plot, recs, limits, dtype, engine.model_name)
        print(f"wrote {args.plot}")
    return 0


def print_cost_model(args, kwargs: dict) -> int:
    """Fit the engine's step-time model (as --scheduling-policy slo does at start-up) and print it,
    with what it predicts for a few steps and the prefill cap it gives for some TPOT targets."""
    from pdserve.engine.cost_model import StepCostModel, step_features
    from pdserve.engine.llm_engine import LLMEngine

    engine = LLMEngine(**kwargs)
    model = engine.cost_model = StepCostModel()
    engine.calibrate_cost_model()
    print(model.describe())
    budget, seats = engine.config.max_num_batched_tokens, engine.config.max_num_seqs
    steps = [(f"prefill {n}", [n], [0]) for n in (64, budget) if n <= budget] + \
            [(f"decode batch {b} at context 256", [1] * b, [256] * b) for b in sorted({1, min(32, seats)})]
    rows = []
    for name, n, ctx in steps:
        t = model.predict(*step_features(n, ctx)[1:])
        rows.append({"step": name, "predicted_ms": 1e3 * t})
        print(f"  {name}: {1e3 * t:.2f} ms")
    b = min(32, seats)
    caps = {}
    for tpot_ms in (25, 50, 100, 200):
        caps[tpot_ms] = model.max_prefill_tokens(tpot_ms / 1e3, b, b * 257, budget)
        print(f"  TPOT {tpot_ms} ms beside {b} decodes at context 256: at most {caps[tpot_ms]} prefill tokens a step")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"model": args.model, "cost_model": model.as_dict(), "predictions": rows,
                       "prefill_cap_by_tpot_ms": caps}, f, indent=1)
        print(f"wrote {args.output}")
    return 0
