"""argparse types every command shares, and the flags generated from config dataclasses: a bad
value is the usual one-line `argument --flag: ...` error, worded the same whichever command took
it, and a setting is declared once, as a field, whichever commands take it."""
import argparse
import dataclasses
import math
import os


def int_at_least(low: int, high: int | None = None, note: str = ""):
    """An integer >= low (and <= high); `note` follows the bound in the error, e.g. " (0 = no cap)"."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid int value: {text!r}") from None
        if value < low or (high is not None and value > high):
            bound = f">= {low}" if high is None else f"in [{low}, {high}]"
            raise argparse.ArgumentTypeError(f"must be {bound}{note}, got {value}")
        return value
    parse.__name__ = "int"
    return parse


def number_at_least(low: float):
    """A finite number >= low."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not value >= low or math.isinf(value):
            raise argparse.ArgumentTypeError(f"must be a number >= {low:g}, got {text!r}")
        return value
    return parse


def seconds(text: str) -> float:
    """A duration: a finite number of seconds > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a number of seconds > 0, got {text!r}")
    return value


def option(default, help: str, repr: bool = True, **argparse_kwargs):
    """A config field that is also a command-line flag (--field-name), its help shown by --help;
    add_config_args generates the flags. Besides argparse's own keywords: `min`/`max` bound an
    integer (`note` is added to that error), `flag` names the flag when it is not the field's
    name, `env` is an environment variable that gives the flag's default, `listen` marks a setting
    of every pdserve HTTP server (the proxy takes it too); repr=False keeps a secret out of the
    config's repr. A list default is copied for each config."""
    if isinstance(default, list):
        return dataclasses.field(default_factory=default.copy, repr=repr, metadata=dict(help=help, **argparse_kwargs))
    return dataclasses.field(default=default, repr=repr, metadata=dict(help=help, **argparse_kwargs))


def option_fields(config_cls, listen_only: bool = False) -> list[dataclasses.Field]:
    """The fields of `config_cls` declared with option() (only the `listen` ones if asked)."""
    return [f for f in dataclasses.fields(config_cls)
            if "help" in f.metadata and (f.metadata.get("listen", False) or not listen_only)]


def default_of(f: dataclasses.Field):
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def add_config_args(group, config_cls, listen_only: bool = False) -> list[str]:
    """One flag per option() field of `config_cls`, in field order; returns the field names."""
    names = []
    for f in option_fields(config_cls, listen_only):
        meta = dict(f.metadata)
        help_text, low, high, note = meta.pop("help"), meta.pop("min", None), meta.pop("max", None), meta.pop("note", "")
        flag, env = meta.pop("flag", "--" + f.name.replace("_", "-")), meta.pop("env", None)
        meta.pop("listen", None)
        default = default_of(f)
        if env is not None:
            default = os.environ.get(env, default)
        kw = dict(default=default, **meta)
        kind = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
        if "action" in kw or "type" in kw:
            pass
        elif kind.startswith("bool"):
            kw["action"] = argparse.BooleanOptionalAction
        elif kind.startswith("int"):
            kw["type"] = int if low is None else int_at_least(low, high, note=note)
        elif kind.startswith("float"):
            kw["type"] = float
        shown = "off" if default_of(f) is None and kind.startswith(("int", "str", "bool")) else "%(default)s"
        group.add_argument(flag, dest=f.name,
                           help=f"{help_text} (default: {shown})" if "default:" not in help_text else help_text, **kw)
        names.append(f.name)
    return names


def config_from_args(config_cls, args: argparse.Namespace, **given):
    """`config_cls` from parsed flags (its option() fields), with `given` fields set instead."""
    values = {f.name: getattr(args, f.name) for f in option_fields(config_cls) if hasattr(args, f.name)}
    return config_cls(**{**values, **given})
