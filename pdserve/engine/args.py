"""Engine options shared by every command that builds an engine (serve, generate, roofline):
one flag per EngineConfig field declared with config.option, so a new engine setting is one
field there and nothing here."""
import argparse
import dataclasses
import os

from pdserve.arg_types import int_at_least
from pdserve.config import EngineConfig

DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.dirname(__file__)), "data", "default-model")


def add_config_args(group, config_cls) -> list[str]:
    """One --flag per field of `config_cls` declared with config.option; returns the field names."""
    names = []
    for f in dataclasses.fields(config_cls):
        meta = dict(f.metadata)
        if "help" not in meta:
            continue
        help_text, low, note = meta.pop("help"), meta.pop("min", None), meta.pop("note", "")
        kw = dict(default=f.default, **meta)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if kind.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("int"):
            kw["type"] = int if low is None else int_at_least(low, note=note)
        elif kind.startswith("float"):
            kw["type"] = float
        shown = "off" if f.default is None and kind.startswith(("int", "str", "bool")) else "%(default)s"
        group.add_argument("--" + f.name.replace("_", "-"), dest=f.name,
                           help=f"{help_text} (default: {shown})" if "(default:" not in help_text else help_text, **kw)
        names.append(f.name)
    return names


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
