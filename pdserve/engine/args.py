"""Engine options shared by every command that builds an engine (serve, generate, roofline):
one flag per EngineConfig field declared with arg_types.option, so a new engine setting is one
field there and nothing here."""
import argparse
import os

from pdserve.arg_types import add_config_args
from pdserve.config import EngineConfig

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "default-model")


ENGINE_FIELDS: list[str] = []


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL,
                   help="HF-format checkpoint directory, or a GGUF file (or a directory holding one) "
                        "(default: the bundled default model)")
    ENGINE_FIELDS[:] = add_config_args(g, EngineConfig)
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
    return dict(model=args.model, **{name: getattr(args, name) for name in ENGINE_FIELDS})
