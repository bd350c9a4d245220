"""Engine options shared by every command that builds an engine (serve, generate, bench...)."""
import argparse
import os

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "default-model")


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF-format checkpoint directory (default: the bundled default model)")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weight and activation dtype; auto = the checkpoint's torch_dtype on GPU, float32 on CPU "
                        "(equal to transformers; bfloat16 is faster on CPUs with AVX512-BF16)")
    g.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available, else cpu)")
    g.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="number of KV-cache blocks (overrides --kv-cache-memory)")
    g.add_argument("--kv-cache-memory", type=int, default=None,
                   help="bytes of memory for the KV cache (default: enough for max-num-seqs full-length "
                        "sequences, capped at 4 GiB)")
    g.add_argument("--max-num-batched-tokens", type=int, default=512,
                   help="token budget of one engine step (prefill chunks + decodes)")
    g.add_argument("--max-num-seqs", type=int, default=64, help="most sequences in one engine step")
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
    # vLLM's and transformers' flag, refused with a one-line error rather than "unrecognized arguments"
    g.add_argument("--trust-remote-code", nargs=0, action=_RefuseRemoteCode, help=argparse.SUPPRESS)


class _RefuseRemoteCode(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        parser.exit(2, f"{parser.prog}: error: --trust-remote-code is not supported: pdserve never runs code "
                       "from checkpoints (supported architectures are built in)\n")


def engine_kwargs(args: argparse.Namespace) -> dict:
    """The LLMEngine/LLM keyword arguments from parsed engine args."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                num_kv_blocks=args.num_kv_blocks, kv_cache_memory=args.kv_cache_memory,
                max_num_batched_tokens=args.max_num_batched_tokens, max_num_seqs=args.max_num_seqs,
                max_model_len=args.max_model_len, seed=args.seed,
                quantization=args.quantization, cpu_kernels=args.cpu_kernels,
                profile_steps=args.profile_steps)
