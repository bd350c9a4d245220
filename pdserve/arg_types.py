"""argparse types every command shares: a bad value is the usual one-line `argument --flag: ...`
error, worded the same whichever command took it."""
import argparse
import math


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
