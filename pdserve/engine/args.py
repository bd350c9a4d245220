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
                        "(equal to transformers; bfloat16 is faster on CPUs with AVX512-BF16) (default: %(default)s)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    g.add_argument("--block-size", type=int_at_least(1), default=16, help="tokens per KV-cache block (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int_at_least(1), default=None,
                   help="number of KV-cache blocks (overrides --kv-cache-memory; default: from --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=int_at_least(1), default=None,
                   help="bytes of memory for the KV cache (default: enough for max-num-seqs full-length "
                        "sequences, capped at 4 GiB)")
    g.add_argument("--max-num-batched-tokens", type=int_at_least(1), default=512,
                   help="token budget of one engine step (prefill chunks + decodes) (default: %(default)s)")
    g.add_argument("--max-prefill-tokens-with-decodes", type=int_at_least(0, " (0 = no cap)"), metavar="N",
                   default=0,
                   help="in a step that also decodes, at most N prefill tokens in all, so a long prompt does not "
                        "stall running streams (a step without decodes still takes the whole "
                        "--max-num-batched-tokens); 32 keeps streams even on a 0.5B CPU model at some cost in "
                        "throughput and queued TTFT; 0 = no cap (default)")
    g.add_argument("--max-num-seqs", type=int_at_least(1), default=64, help="most sequences in one engine step (default: %(default)s)")
    g.add_argument("--max-model-len", type=int_at_least(1), default=None,
                   help="longest prompt + output, at most the model's max_position_embeddings "
                        "(default: max_position_embeddings)")
    g.add_argument("--seed", type=int, default=0, help="seed for requests that give none (default: %(default)s)")
    g.add_argument("--quantization", default=None, choices=["int8"],
                   help="weight-only int8 linears (default: none, the checkpoint's weights) (per-channel scales; CPU only; docs/BENCHMARKS.md has its "
                        "speed and accuracy)")
    g.add_argument("--cpu-kernels", default=None, action=argparse.BooleanOptionalAction,
                   help="CPU: run linears on pre-packed weights and decode attention on pdserve's own kernels "
                        "(default: yes where they build: x86 with AVX-512 and a C++ compiler); "
                        "--no-cpu-kernels uses torch's ops")
    g.add_argument("--profile-steps", type=int_at_least(0), default=None, metavar="N",
                   help="step profiler: log where engine steps spend their time (schedule, prepare, forward, "
                        "sample, output; overhead = all but the forward) every N steps (default: off)")
    # vLLM's and transformers' flag, refused with a one-line error rather than "unrecognized arguments"
    g.add_argument("--trust-remote-code", nargs=0, action=_RefuseRemoteCode, help=argparse.SUPPRESS)


class _RefuseRemoteCode(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: --trust-remote-code is not supported: pdserve never runs code "
                       "from checkpoints (supported architectures are built in)\n")


def check_engine_args(args: argparse.Namespace) -> None:
    """What can be checked before loading: --max-model-len against the checkpoint's own limit
    (a ConfigError, which the CLI prints as one line)."""
    from pdserve.config import ModelConfig
    from pdserve.errors import ConfigError
    if args.max_model_len is not None:
        limit = ModelConfig.from_dir(args.model).max_position_embeddings
        if args.max_model_len > limit:
            raise ConfigError(f"--max-model-len {args.max_model_len} is more than the model's "
                              f"max_position_embeddings ({limit})")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLMEngine/LLM keyword arguments from parsed engine args."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
                max_model_len=args.max_model_len, seed=args.seed,
                quantization=args.quantization, cpu_kernels=args.cpu_kernels,
                profile_steps=args.profile_steps)
