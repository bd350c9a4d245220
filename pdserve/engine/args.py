"""Engine options shared by every command that builds an engine (serve, generate, bench...)."""
import argparse
import os

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "default-model")


def int_at_least(low: int, note: str = ""):
    """An argparse type: an integer >= low, else the usual one-line `argument --flag: ...` error."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}{note}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF-format checkpoint directory (default: the bundled default model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype on GPU, float32 on CPU "
                        "(equal to transformers; bfloat16 is faster on CPUs with AVX512-BF16)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    g.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int_at_least(1), default=None,
                   help="number of KV-cache blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=int_at_least(1), default=None,
                   help="bytes of memory for the KV cache (default: enough for max-num-seqs full-length "
                        "sequences, capped at 4 GiB)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512,
                   help="token budget of one engine step (prefill chunks + decodes)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int_at_least(0, " (0 = no cap)"), metavar="N",
                   default=0,
                   help="in a step that also decodes, at most N prefill tokens in all, so a long prompt does not "
                        "stall running streams (a step without decodes still takes the whole "
                        "--max-num-batched-tokens); 32 keeps streams even on a 0.5B CPU model at some cost in "
                        "throughput and queued TTFT; 0 = no cap (default)")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=64, help="most sequences in one engine step")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's max_position_embeddings)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none")
    g.add_argument("--quantization", default=None, choices=["int8"],
                   help="weight-only int8 linears (per-channel scales; CPU only; docs/BENCHMARKS.md has its "
                        "speed and accuracy)")
    g.add_argument("--cpu-kernels", default=None, action=argparse.BooleanOptionalAction,
                   help="CPU: run linears on pre-packed weights and decode attention on pdserve's own kernels "
                        "(default: yes where they build: x86 with AVX-512 and a C++ compiler); "
                        "--no-cpu-kernels uses torch's ops")
    g.add_argument("--profile-steps", type=int, default=None, metavar="N",
                   help="step profiler: log where engine steps spend their time (schedule, prepare, forward, "
                        "sample, output; overhead = all but the forward) every N steps")
    s = parser.add_argument_group("scheduling (docs/API.md: priority and slo)")
    s.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority", "slo"],
                   help="fcfs: arrival order (default); priority: by each request's priority (lower first), a "
                        "waiting request may preempt lower-priority running ones; slo: prefills by TTFT slack, "
                        "a step's prefill tokens sized to keep the tightest TPOT target, by a step-time model "
                        "calibrated at start-up (a few seconds) and refreshed from measured steps")
    s.add_argument("--slo-ttft-ms", type=_positive_ms, default=None, metavar="MS",
                   help="TTFT target of requests that give no slo.ttft_ms (default: none)")
    s.add_argument("--slo-tpot-ms", type=_positive_ms, default=None, metavar="MS",
                   help="TPOT target of requests that give no slo.tpot_ms (default: none)")
    s.add_argument("--slo-admission", default="serve", choices=["serve", "reject"],
                   help="slo policy: reject refuses at once (503 slo_unattainable) a request whose TTFT target "
                        "the step-time model says cannot be met; serve queues it anyway (default)")
    # vLLM's and transformers' flag, refused with a one-line error rather than "unrecognized arguments"
    g.add_argument("--trust-remote-code", nargs=0, action=_RefuseRemoteCode, help=argparse.SUPPRESS)


def _positive_ms(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid number of milliseconds: {text!r}") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a number of milliseconds > 0, got {text}")
    return value


class _RefuseRemoteCode(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: --trust-remote-code is not supported: pdserve never runs code "
                       "from checkpoints (supported architectures are built in)\n")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLMEngine/LLM keyword arguments from parsed engine args."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
                max_model_len=args.max_model_len, seed=args.seed,
                quantization=args.quantization, cpu_kernels=args.cpu_kernels,
                profile_steps=args.profile_steps, scheduling_policy=args.scheduling_policy,
                slo_ttft_ms=args.slo_ttft_ms, slo_tpot_ms=args.slo_tpot_ms, slo_admission=args.slo_admission)
