"""The labs' shared loop: engine decode forwards (0.5B, context 256) for each batch size, under
each variant of a lab build's switch, the variants alternating within one process (the order
reversed every other round); prints each variant's median and the first variant's time over the
others' per round.

Env: BS (batch sizes), VS (variants, `a:b` for a switch of two arguments), ROUNDS, REPS."""
import os
import statistics

from pdserve.benchmarks.roofline import time_step


def variants(default: str) -> list[tuple[int, ...]]:
    return [tuple(map(int, v.split(":"))) for v in os.environ.get("VS", default).split(",")]


def run(engine, switch, vs: list[tuple[int, ...]], batches: str) -> None:
    """switch(*v) selects variant v in the lab build."""
    ids = list(range(1000, 1000 + 4096))
    bs = [int(b) for b in os.environ.get("BS", batches).split(",")]
    res = {}
    for r in range(int(os.environ.get("ROUNDS", "6"))):
        for b in bs:
            for v in (vs if r % 2 == 0 else vs[::-1]):
                switch(*v)
                fw, _ = time_step(engine, [(1, 256)] * b, ids, int(os.environ.get("REPS", "5")))
                res.setdefault((b, v), []).append(statistics.median(fw) * 1e3)
    for b in bs:
        base = res[(b, vs[0])]
        line = f"b{b}: " + " ".join(f"{v} {statistics.median(res[(b, v)]):.1f}" for v in vs) + " ms"
        for v in vs[1:]:
            rr = [x / y for x, y in zip(base, res[(b, v)])]
            line += f"; {vs[0]}/{v} per round " + " ".join(f"{x:.3f}" for x in rr) + f" median {statistics.median(rr):.3f}"
        print(line, flush=True)
