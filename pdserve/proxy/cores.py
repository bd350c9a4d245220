"""CPU core lists (`0-3,8`, as taskset and /sys write them) and the split of this process's
cores between a prefill and a decode worker."""
import argparse

from pdserve.errors import ConfigError


def parse_cores(text: str) -> list[int]:
    """An argparse type: `0`, `0,2`, `0-3,8` -> sorted core ids."""
    cores = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.strip().partition("-")
            lo, hi = int(lo), int(hi) if hi else int(lo)
            if lo < 0 or hi < lo:
                raise ValueError
            cores.update(range(lo, hi + 1))
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a core list such as 0, 0,2 or 0-3,8; got {text!r}") from None
    return sorted(cores)


def format_cores(cores) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    cores, runs = sorted(cores), []
    for c in cores:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def split_cores(prefill: list[int] | None, decode: list[int] | None, allowed: set[int]) -> tuple[list, list]:
    """(prefill cores, decode cores): as given, checked against `allowed` (this process's affinity
    mask) and each other; a list not given is the rest of `allowed`; neither given: half each
    (prefill gets the odd one)."""
    available = sorted(allowed)
    for flag, cores in (("--prefill-cores", prefill), ("--decode-cores", decode)):
        if cores is not None and not set(cores) <= allowed:
            raise ConfigError(f"{flag} {format_cores(cores)}: core(s) {format_cores(set(cores) - allowed)} are not "
                              f"available to this process (it may use {format_cores(available)})")
    if prefill is None and decode is None:
        if len(available) < 2:
            raise ConfigError(f"--disaggregate needs two cores to split and this process may use only "
                              f"{format_cores(available)}")
        half = (len(available) + 1) // 2
        return available[:half], available[half:]
    if prefill is None:
        prefill = [c for c in available if c not in decode]
    if decode is None:
        decode = [c for c in available if c not in prefill]
    if not prefill or not decode:
        raise ConfigError(f"no cores left for the {'prefill' if not prefill else 'decode'} worker (this process "
                          f"may use {format_cores(available)})")
    shared = set(prefill) & set(decode)
    if shared:
        raise ConfigError(f"--prefill-cores and --decode-cores share core(s) {format_cores(shared)}: each worker "
                          "needs its own")
    return list(prefill), list(decode)
