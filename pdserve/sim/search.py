"""Placement search, as DistServe does it: for each way to use M machines (M colocated replicas,
or P prefill + D decode workers with P + D = M), the highest request rate at which at least a
given share of requests meets every SLO; the best placement has the highest such rate per machine."""
from collections.abc import Callable

from pdserve.sim.cluster import Placement

BISECTIONS = 4   # to within 2**(1/16), about 4%
MAX_DOUBLINGS = 24


def placements(machines: int, prefill_share: float | None = None) -> list[Placement]:
    """Colocated first, then the P + D splits: every one up to 8 machines; beyond, P on a grid of
    sixteenths of M, or only the three grid points nearest prefill_share (the best split's P / M
    at a smaller M, where the search already went through them all)."""
    out = [Placement(replicas=machines)]
    if machines < 2:
        return out
    if machines <= 8:
        ps = range(1, machines)
    else:
        grid = sorted({min(machines - 1, max(1, round(machines * k / 16))) for k in range(1, 16)})
        if prefill_share is not None:
            grid = sorted(grid, key=lambda p: abs(p / machines - prefill_share))[:3]
        ps = sorted(grid)
    return out + [Placement(prefill=p, decode=machines - p) for p in ps]


def max_rate(run: Callable[[float], dict], attainment: float, start: float) -> tuple[float, dict] | None:
    """The highest rate (req/s) whose run(rate)["goodput_attainment"] >= attainment: doubling from
    `start` to the first miss, then bisection (geometric); None if even start / 2**24 misses."""
    good = bad = None
    rate = start
    for _ in range(MAX_DOUBLINGS):
        m = run(rate)
        if m["goodput_attainment"] >= attainment:
            good = (rate, m)
            if bad is not None:
                break
            rate *= 2
        else:
            bad = rate
            if good is not None:
                break
            rate /= 2
    if good is None:
        return None
    if bad is None:
        return good
    lo, hi = good[0], bad
    for _ in range(BISECTIONS):
        mid = (lo * hi) ** 0.5
        m = run(mid)
        if m["goodput_attainment"] >= attainment:
            lo, good = mid, (mid, m)
        else:
            hi = mid
    return good


def search(machines: int, run_at: Callable[[Placement, float], dict], attainment: float, start_per_machine: float,
           prefill_share: float | None = None) -> list[dict]:
    """Rows, best first: each placement's highest rate meeting the attainment, and per machine."""
    rows = []
    for p in placements(machines, prefill_share):
        found = max_rate(lambda rate: run_at(p, rate), attainment, start_per_machine * machines)
        row = {"placement": p.label, "machines": p.machines, "prefill": p.prefill, "decode": p.decode,
               "max_rate": None, "goodput_per_machine": None}
        if found is not None:
            rate, m = found
            row.update(m, max_rate=rate, rate=round(rate, 3), goodput_per_machine=rate / p.machines)
        rows.append(row)
    rows.sort(key=lambda r: -(r["goodput_per_machine"] or 0.0))
    return rows
