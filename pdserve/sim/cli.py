"""`pdserve simulate`: predict TTFT, TPOT, throughput and goodput of a deployment (N replicas,
or xPyD pools) on a workload, with pdserve's own scheduler and a step-time model in place of
the forward; `--search` finds the best prefill/decode split of M machines for a goodput target."""
import argparse
import json
import math
import os
import sys

from pdserve.bench import bench_metrics
from pdserve.bench.datasets import add_dataset_arguments
from pdserve.arg_types import int_at_least
from pdserve.engine.args import add_engine_args, engine_kwargs

GB = 1e9


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("step-time model (one of)")
    g.add_argument("--cost-model", metavar="FILE.json", default=None,
                   help="a fitted step-time model: `pdserve simulate --fit-cost-model --save-cost-model FILE` or "
                        "`pdserve roofline --cost-model --output FILE`")
    g.add_argument("--fit-cost-model", action="store_true",
                   help="fit the model now on this machine for --model and the engine flags (tens of seconds)")
    g.add_argument("--step-log", metavar="FILE.jsonl", nargs="+", default=None,
                   help="fit the model on servers' own steps (`pdserve serve --step-log FILE`; several files, e.g. "
                        "a prefill and a decode worker's, make one model)")
    g.add_argument("--gpu", choices=("a100", "h100", "h200"), default=None,
                   help="a roofline of this GPU's datasheet rates (a prediction from assumed efficiencies)")
    g.add_argument("--prefill-cost-model", metavar="FILE.json", default=None,
                   help="disaggregated: the prefill workers' own fitted model (default: the one model)")
    g.add_argument("--prefill-step-log", metavar="FILE.jsonl", nargs="+", default=None,
                   help="disaggregated: fit the prefill workers' own model on their steps (with --step-log: the "
                        "decode workers')")
    g.add_argument("--save-cost-model", metavar="FILE.json", default=None, help="with --fit-cost-model: write it")
    g.add_argument("--mfu", type=float, default=0.5, help="--gpu: assumed share of peak FLOP/s (default: %(default)s)")
    g.add_argument("--mbu", type=float, default=0.8,
                   help="--gpu: assumed share of memory bandwidth (default: %(default)s)")
    g.add_argument("--step-overhead-ms", type=float, default=3.0,
                   help="--gpu: fixed time per engine step (scheduling, launches, outputs) (default: %(default)s)")
    g = parser.add_argument_group("deployment")
    g.add_argument("--replicas", type=int_at_least(1), default=1, help="colocated engines (default: 1)")
    g.add_argument("--prefill-replicas", type=int_at_least(1), default=None, metavar="X",
                   help="disaggregated: X prefill workers (with --decode-replicas)")
    g.add_argument("--decode-replicas", type=int_at_least(1), default=None, metavar="Y", help="and Y decode workers")
    g.add_argument("--router", choices=("round-robin", "least-loaded", "prefix-aware"), default="round-robin",
                   help="which replica gets a request; prefix-aware is the Ray app's and the proxy's router (pdserve/routing.py) "
                        "(default: %(default)s)")
    g.add_argument("--router-latency-ms", type=float, default=0.0,
                   help="what the router's or proxy's hops add to each request, there and back (a Ray ingress, "
                        "an HTTP proxy); it reaches its replica this much later (default: %(default)s)")
    g.add_argument("--kv-bandwidth", type=float, default=10.0, metavar="GB/S",
                   help="disaggregated: K/V transfer bandwidth, GB/s (default: %(default)s)")
    g.add_argument("--kv-latency-ms", type=float, default=2.0,
                   help="disaggregated: fixed time per hand-off (proxy hop and pull round trip) (default: %(default)s)")
    add_engine_args(parser)
    add_dataset_arguments(parser)
    g = parser.add_argument_group("load (as pdserve bench)")
    g.add_argument("--trace", metavar="FILE", default=None,
                   help='requests from a JSONL trace ({"arrival": s, "prompt_len": n, "output_len": m} per line) '
                        "or a `pdserve bench --output` result, instead of a dataset")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="mean requests per second; inf sends them all at once (default: %(default)s)")
    g.add_argument("--burstiness", type=float, default=1.0, help="Gamma shape of the gaps (default: 1, Poisson)")
    g.add_argument("--max-concurrency", type=int_at_least(1), default=None, help="most requests in flight at once")
    # --seed (an engine flag) also seeds the prompts and arrival times, as pdserve bench's --seed
    g = parser.add_argument_group("results")
    g.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="SLOs for goodput, as pdserve bench's: e.g. ttft:2000 tpot:150")
    g.add_argument("--search", action="store_true",
                   help="find, for --machines M, the placement (M replicas or P prefill + D decode workers) with the "
                        "highest rate per machine at which --attainment of requests meet --goodput; --num-prompts "
                        "is then per machine")
    g.add_argument("--machines", default="8", metavar="M[,M...]", help="--search: machine counts (default: 8)")
    g.add_argument("--search-span", type=float, default=30.0, metavar="S",
                   help="--search: at least this many seconds of arrivals at each rate tried (default: %(default)s)")
    g.add_argument("--attainment", type=float, default=0.9,
                   help="--search: share of requests that must meet every SLO (default: %(default)s)")
    g.add_argument("--output", default=None, metavar="FILE", help="write the result as JSON")


def build(args):
    """(ReplicaSpec, step time, KV bytes per token) from the parsed flags; ValueError on bad ones."""
    from pdserve.bench.step_cost import ModelCost
    from pdserve.config import EngineConfig, ModelConfig
    from pdserve.sim import costs
    from pdserve.sim.cluster import ReplicaSpec, kv_blocks

    chosen = [f for f, on in (("--cost-model", args.cost_model), ("--fit-cost-model", args.fit_cost_model),
                              ("--step-log", args.step_log), ("--gpu", args.gpu)) if on]
    if len(chosen) != 1:
        raise ValueError("give one step-time model: --cost-model FILE, --fit-cost-model, --step-log FILE or --gpu NAME"
                         + (f" (got {' and '.join(chosen)})" if chosen else ""))
    if args.save_cost_model and not args.fit_cost_model:
        raise ValueError("--save-cost-model needs --fit-cost-model")
    kwargs = engine_kwargs(args)
    model_cfg = ModelConfig.from_dir(args.model)
    limit = model_cfg.max_position_embeddings
    if args.max_model_len is not None and args.max_model_len > limit:
        raise ValueError(f"--max-model-len {args.max_model_len} is more than the model's {limit}")
    max_model_len = min(args.max_model_len or limit, limit)
    # the KV cache's dtype, as the engine picks it: auto is float32 on CPU, the checkpoint's on a GPU
    on_gpu = args.gpu is not None or (args.device or "").startswith("cuda")
    dtype = args.dtype if args.dtype != "auto" else (model_cfg.torch_dtype or "float32") if on_gpu else "float32"
    itemsize = 2 if dtype in ("bfloat16", "float16") else 4
    cfg = EngineConfig(**{**kwargs, "device": "cpu"})   # the simulated replicas' flags (no device is used)
    if cfg.speculative() is not None:   # drafts and their acceptance would need a model of their own
        raise ValueError("the simulator does not model speculative decoding: leave out --num-speculative-tokens, "
                         "--speculative-model and --speculative-config")
    cost = ModelCost.from_config(model_cfg, itemsize)
    bytes_per_block = cost.kv_bytes_per_token * cfg.block_size
    if args.gpu:
        gpu = costs.GPUS[args.gpu]
        weights = (cost.body_matmul_params + cost.body_other_params + cost.lm_head_params) * itemsize
        free = 0.9 * gpu.memory - weights
        if free <= 0:
            raise ValueError(f"the model's weights ({weights / GB:.1f} GB) do not fit a {gpu.name}")
        step_time = costs.DatasheetStepTime(gpu, cost, args.mfu, args.mbu, args.step_overhead_ms / 1e3)
        num_blocks = kv_blocks(cfg, bytes_per_block, max_model_len, free)
    else:
        if args.fit_cost_model:
            from pdserve.sim.calibrate import fit_here, save
            record = fit_here(kwargs)
            print(record["describe"], file=sys.stderr)
            if args.save_cost_model:
                save(record, args.save_cost_model)
                print(f"wrote {args.save_cost_model}", file=sys.stderr)
            model, source = costs.StepCostModel.from_dict(record["cost_model"]), "fitted now"
        elif args.step_log:
            from pdserve.sim.steplog import fit_step_log
            model, source = fit_step_log(args.step_log), f"fitted on the steps in {' '.join(args.step_log)}"
        else:
            model, source = costs.load_cost_model(args.cost_model), args.cost_model
        step_time = costs.FittedStepTime(model, source)
        num_blocks = kv_blocks(cfg, bytes_per_block, max_model_len)
    return ReplicaSpec(cfg, num_blocks, max_model_len, model_cfg.vocab_size), step_time, cost.kv_bytes_per_token


def build_prefill_step_time(args):
    """The prefill workers' own step-time model, where one is given (None: they use the one model)."""
    from pdserve.sim import costs
    if args.prefill_cost_model and args.prefill_step_log:
        raise ValueError("give --prefill-cost-model or --prefill-step-log, not both")
    if not (args.prefill_cost_model or args.prefill_step_log):
        return None
    if args.prefill_replicas is None and not args.search:
        raise ValueError("--prefill-cost-model and --prefill-step-log need --prefill-replicas (or --search)")
    if args.prefill_step_log:
        from pdserve.sim.steplog import fit_step_log
        return costs.FittedStepTime(fit_step_log(args.prefill_step_log),
                                    f"fitted on the steps in {' '.join(args.prefill_step_log)}")
    return costs.FittedStepTime(costs.load_cost_model(args.prefill_cost_model), args.prefill_cost_model)


def check_args(args) -> dict:
    slos = bench_metrics.parse_goodput(args.goodput)
    if args.num_prompts is not None and args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be at least 1, got {args.num_prompts}")
    if not (args.request_rate > 0 and args.burstiness > 0):
        raise ValueError(f"--request-rate and --burstiness must be positive, got {args.request_rate} and "
                         f"{args.burstiness}")
    if (args.prefill_replicas is None) != (args.decode_replicas is None):
        raise ValueError("--prefill-replicas and --decode-replicas go together")
    if not (args.kv_bandwidth > 0 and math.isfinite(args.kv_bandwidth)) or args.kv_latency_ms < 0:
        raise ValueError("--kv-bandwidth must be > 0 GB/s and --kv-latency-ms >= 0")
    if not (args.router_latency_ms >= 0 and math.isfinite(args.router_latency_ms)):
        raise ValueError(f"--router-latency-ms must be >= 0, got {args.router_latency_ms}")
    if args.search:
        if not slos:
            raise ValueError("--search needs --goodput targets, e.g. --goodput ttft:2000 tpot:150")
        if not args.search_span > 0:
            raise ValueError(f"--search-span must be > 0 seconds, got {args.search_span}")
        if not 0 < args.attainment <= 1:
            raise ValueError(f"--attainment must be in (0, 1], got {args.attainment}")
        try:
            args.machines = [int(m) for m in args.machines.split(",")]
        except ValueError:
            raise ValueError(f"--machines takes comma-separated counts, got {args.machines!r}") from None
        if not args.machines or min(args.machines) < 1:
            raise ValueError("--machines counts must be at least 1")
    return slos


def run(args) -> int:
    from pdserve.sim import report, search, workload
    from pdserve.sim.cluster import KVTransfer, Placement, Simulation

    try:
        slos = check_args(args)
        spec, step_time, kv_bytes = build(args)
        prefill_step_time = build_prefill_step_time(args)
        transfer = KVTransfer(kv_bytes, args.kv_bandwidth * GB, args.kv_latency_ms / 1e3)
        if args.trace:
            requests = workload.load_trace(args.trace, spec.vocab_size, args.seed)
        else:
            requests = workload.bench_workload(args, spec.vocab_size,
                                               None if args.search else args.num_prompts, args.request_rate)
    except (ValueError, KeyError) as e:
        print(f"pdserve simulate: error: {e}", file=sys.stderr)
        return 2
    print(step_time.describe())
    if prefill_step_time is not None:
        print(f"prefill workers: {prefill_step_time.describe()}")
    print(f"replica: {spec.num_blocks} KV blocks of {spec.cfg.block_size} tokens, budget "
          f"{spec.cfg.max_num_batched_tokens} tokens, {spec.cfg.max_num_seqs} seats, policy "
          f"{spec.cfg.scheduling_policy}")

    def simulate(placement: Placement, reqs) -> dict:
        sim = Simulation(spec, placement, step_time, args.router, transfer, args.max_concurrency,
                         prefill_step_time if placement.disaggregated else None, args.router_latency_ms / 1e3)
        m = report.summarize(sim.run(reqs), slos)
        return {"placement": placement.label, "machines": placement.machines, **m}

    out = {"step_time": step_time.describe(), "kind": step_time.kind, "goodput_slos_ms": slos or None,
           "prefill_step_time": prefill_step_time.describe() if prefill_step_time is not None else None,
           "router": args.router, "max_concurrency": args.max_concurrency}
    if args.search:
        per_machine = args.num_prompts or 100
        base = requests if args.trace else None
        start = args.request_rate if math.isfinite(args.request_rate) else 1.0
        out["search"], share = {}, None

        def requests_at(machines: int, rate: float):
            """The workload at this rate: --num-prompts per machine, and at least --search-span
            seconds of arrivals (a short burst would measure the queue's depth, not the rate)."""
            if base is not None:
                return workload.rescale(base, rate, args.burstiness, args.seed)
            n = max(per_machine * machines, math.ceil(rate * args.search_span))
            return workload.bench_workload(args, spec.vocab_size, n, rate)

        for machines in sorted(set(args.machines)):
            rows = search.search(machines, lambda p, rate: simulate(p, requests_at(machines, rate)),
                                 args.attainment, start, share)
            out["search"][str(machines)] = rows
            disagg = [r for r in rows if r["prefill"] and r["goodput_per_machine"]]
            if disagg:   # where the next, larger count looks first (it tries 3 splits there, not all)
                share = disagg[0]["prefill"] / machines
            if rows[0]["goodput_per_machine"]:
                start = rows[0]["goodput_per_machine"]
            print()
            print(report.table(rows, f"{machines} machines: highest rate with >= {args.attainment:.0%} of requests "
                                     f"meeting {' '.join(args.goodput)} (prediction)"))
            best = rows[0]
            if best["goodput_per_machine"]:
                print(f"best: {best['placement']}, {best['goodput_per_machine']:.3f} req/s per machine")
    else:
        if args.prefill_replicas:
            placement = Placement(prefill=args.prefill_replicas, decode=args.decode_replicas)
        else:
            placement = Placement(replicas=args.replicas)
        row = simulate(placement, requests)
        row["rate"] = args.request_rate if math.isfinite(args.request_rate) else "inf"
        out.update(row)
        print(report.table([row], f"{len(requests)} requests (prediction)"))
        if row.get("first_error"):
            print(f"{row['failed']} requests refused; first: {row['first_error']}")
    if args.output:
        os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
        with open(args.output, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.output}")
    return 0
