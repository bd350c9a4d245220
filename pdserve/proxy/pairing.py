"""The check before the proxy serves: every worker's `GET /v1/kv_transfer` must answer, each must
have the role it was given as, and all must agree on the model, the KV block size and the KV
dtype (a decode worker cannot take blocks of another shape). Any failure is one line."""
from dataclasses import dataclass

import httpx

from pdserve.errors import ConfigError
from pdserve.proxy.workers import Worker

MUST_AGREE = ("model", "block_size", "dtype")


@dataclass
class Pairing:
    model: str
    block_size: int
    dtype: str
    info: dict[str, dict]   # worker URL -> its /v1/kv_transfer answer


def describe(worker: Worker, headers: dict, timeout: float) -> dict:
    try:
        r = httpx.get(worker.url + "/v1/kv_transfer", headers=headers, timeout=timeout)
    except httpx.HTTPError as e:
        raise ConfigError(f"{worker}: cannot reach GET /v1/kv_transfer: {e or type(e).__name__}") from None
    if r.status_code != 200:
        raise ConfigError(f"{worker}: GET /v1/kv_transfer answered HTTP {r.status_code} (is it a "
                          f"`pdserve serve --role {worker.role}` worker?): {r.text[:200]}")
    try:
        info = r.json()
    except ValueError:
        info = None
    missing = [k for k in ("role", *MUST_AGREE) if not isinstance(info, dict) or k not in info]
    if missing:
        raise ConfigError(f"{worker}: GET /v1/kv_transfer lacks {', '.join(missing)}: {r.text[:200]}")
    return info


def check_pairing(prefill: list[Worker], decode: list[Worker], headers: dict | None = None,
                  timeout: float = 5.0) -> Pairing:
    """What the workers agree on; ConfigError naming the first worker that does not fit."""
    workers = prefill + decode
    seen = [w.url for w in workers]
    twice = sorted({u for u in seen if seen.count(u) > 1})
    if twice:
        raise ConfigError(f"a worker is given more than once: {', '.join(twice)}")
    return check_described(workers, {w.url: describe(w, headers or {}, timeout) for w in workers})


def check_described(workers: list[Worker], info: dict[str, dict]) -> Pairing:
    """The checks on what the workers said (worker URL -> its /v1/kv_transfer answer): shared
    with the Ray app, which asks its replicas through Serve instead of over HTTP."""
    for w in workers:
        if info[w.url]["role"] != w.role:
            raise ConfigError(f"--{w.role} {w.url} is a worker with role {info[w.url]['role']!r}, not "
                              f"{w.role!r} (start it with `pdserve serve --role {w.role}`)")
    first = workers[0]
    for key in MUST_AGREE:
        for w in workers[1:]:
            if info[w.url][key] != info[first.url][key]:
                raise ConfigError(f"the workers disagree on {key}: {first} has {info[first.url][key]!r}, "
                                  f"{w} has {info[w.url][key]!r}")
    for w in workers:   # a lease is made for one decode worker, by this id
        w.engine_id = info[w.url].get("engine_id")
    return Pairing(*(info[first.url][k] for k in MUST_AGREE), info=info)
