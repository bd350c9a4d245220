"""Fuzz: schemathesis against the server's own OpenAPI schema, every endpoint, on loopback.

    python -m benchmarks.fuzz                    # >= 1000 generated cases on a tiny llama (a few minutes)
    python -m benchmarks.fuzz --num-cases 100    # the size tests/reliability/test_fuzz.py runs

It starts `pdserve serve` on a tiny random checkpoint with a short context (--max-model-len 128,
so no generated request can decode for long), loads /openapi.json, and lets schemathesis generate
cases for every operation, both ones that fit the schema (positive) and ones that do not
(negative), round after round until --num-cases have been sent. Each response must be:

- not a 5xx, and within --timeout seconds (no hang);
- if not 2xx: OpenAI's error format, {"error": {"message": str, "type": str, "param": str | null,
  "code": str | int | null}}; an error event inside a stream likewise, and not a server_error.

Then the hand-written hostile cases of hostile.py (lone surrogates in every text field, bodies
not sent as JSON, a foreign Host, booleans as integers, 900 KB prompts, amplification) must each
get their 4xx in that format on one keep-alive connection that stays open.

At the end the server must still be alive, and idle: nothing running or waiting, no KV block in
use. The summary is printed and written as JSON (default benchmarks/results/reliability/fuzz.json);
`run_fuzz(model, ...)` is the same run as a function returning it.
"""
import argparse
import collections
import json
import math
import os
import sys
import tempfile
import time

import httpx

HERE = os.path.dirname(os.path.abspath(__file__))
from benchmarks.hostile import check_refusals
from benchmarks.soak import is_idle, wait_idle
from pdserve.bench.servers import Server, free_port
from pdserve.server.web import ENDLESS_STREAMS

DEFAULT_OUT = os.path.join(HERE, "results", "reliability", "fuzz.json")


def error_format_problem(body) -> str | None:
    """Why `body` is not OpenAI's error format (None if it is)."""
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(body) != {"error"}:
        return "not {\"error\": {...}}"
    if set(err) != {"message", "type", "param", "code"}:
        return f"error keys {sorted(err)}"
    if not isinstance(err["message"], str) or not err["message"] or not isinstance(err["type"], str):
        return "message and type must be non-empty strings"
    if err["param"] is not None and not isinstance(err["param"], str):
        return "param must be a string or null"
    if err["code"] is not None and not isinstance(err["code"], (str, int)):
        return "code must be a string, an integer or null"
    return None


def check_response(status: int, content_type: str, text: str) -> str | None:
    """What is wrong with one response (None if nothing)."""
    if status >= 500:
        return f"HTTP {status}"
    if content_type.startswith("text/event-stream"):
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                event = json.loads(line[6:])
                if "error" in event:
                    why = error_format_problem(event)
                    if why or event["error"]["type"] == "server_error":
                        return f"error event in the stream: {why or event['error']}"
        return None
    if 200 <= status < 300:
        return None
    try:
        body = json.loads(text)
    except ValueError:
        return f"HTTP {status} with a body that is not JSON"
    why = error_format_problem(body)
    return f"HTTP {status} not in OpenAI's error format ({why})" if why else None


def fuzz_operation(op, mode, max_examples: int, seed: int, base_url: str, timeout: float, record) -> None:
    """Send up to `max_examples` generated cases of one operation; `record(op, case, status, seconds, problem)`."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hyp_seed
    from hypothesis.errors import Unsatisfiable

    @hyp_seed(seed)
    @settings(max_examples=max_examples, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(op.as_strategy(mode))
    def one(case):
        t0 = time.monotonic()
        try:
            r = case.call(base_url=base_url, timeout=timeout)
            content_type = (r.headers.get("content-type") or [""])[0]   # schemathesis: header -> list of values
            status, problem = r.status_code, check_response(r.status_code, content_type, r.text)
        except Exception as e:   # a timeout is a hang; a refused connection a crash
            status, problem = None, f"{type(e).__name__}: {e}"
        record(op, case, status, time.monotonic() - t0, problem)

    try:
        one()
    except Unsatisfiable:   # e.g. no value of a plain string path parameter violates the schema
        pass


def run_fuzz(model: str | None = None, num_cases: int = 1000, seed: int = 0, timeout: float = 30.0,
             log_dir: str | None = None) -> dict:
    import schemathesis
    from schemathesis import GenerationMode

    from tools.make_model import make_model
    t_start = time.monotonic()
    tmp = log_dir or tempfile.mkdtemp(prefix="pdserve-fuzz-")   # the server log, and the model if built
    if model is None:
        model = make_model(os.path.join(tmp, "tiny-llama"), "llama")
    port = free_port()
    cmd = [sys.executable, "-m", "pdserve", "serve", "--model", model, "--port", str(port),
           "--max-model-len", "128", "--log-level", "warning"]
    server = Server("fuzz", cmd, port, os.path.join(tmp, "fuzz-server.log")).start(timeout=120)
    cases = collections.Counter()
    statuses = collections.Counter()
    problems, slowest = [], 0.0

    def record(op, case, status, seconds, problem):
        nonlocal slowest
        cases[op.label] += 1
        statuses[str(status)] += 1
        slowest = max(slowest, seconds)
        if problem:
            problems.append({"operation": op.label, "status": status, "problem": problem[:500],
                             "curl": case.as_curl_command()[:1000]})

    try:
        schema = schemathesis.openapi.from_url(server.base_url + "/openapi.json")
        ops = [op for op in (r.ok() for r in schema.get_all_operations()) if op.path not in ENDLESS_STREAMS]
        # Operations without parameters have one case; the budget goes to those with inputs.
        varied = [op for op in ops if op.body or op.path_parameters or op.query]
        per_op = math.ceil(num_cases / (2 * len(varied)))
        rounds = 0
        while sum(cases.values()) < num_cases and rounds < 20:
            for op in ops:
                for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                    if op in varied or (mode.is_positive and rounds == 0):
                        fuzz_operation(op, mode, per_op if op in varied else 1, seed + rounds, server.base_url,
                                       timeout, record)
            rounds += 1
        hostile = check_refusals(server.base_url)   # hand-written cases the generator does not make
        alive = server.proc.poll() is None and httpx.get(server.base_url + "/health", timeout=10).status_code == 200
        idle = wait_idle(server.base_url)
        log = open(server.log_path, encoding="utf-8", errors="replace").read()
    finally:
        server.stop()
    failures = []
    if problems:
        failures.append(f"{len(problems)} bad responses, e.g. {[p['problem'] for p in problems[:3]]}")
    if hostile["problems"]:
        failures.append(f"hostile cases: {hostile['problems'][:3]}")
    if not alive:
        failures.append("the server is not healthy after the fuzz")
    if not is_idle(idle):
        failures.append(f"not idle after the fuzz: running {idle['pdserve:num_requests_running']}, waiting "
                        f"{idle['pdserve:num_requests_waiting']}, kv usage {idle['pdserve:kv_cache_usage_perc']}")
    if "Traceback" in log:
        failures.append("the server log has a traceback: " + log[log.index("Traceback"):][:1500])
    return {
        "ok": not failures, "failures": failures, "cases": sum(cases.values()), "operations": len(ops),
        "cases_by_operation": dict(cases), "status_codes": dict(sorted(statuses.items())),
        "server_errors_5xx": sum(v for k, v in statuses.items() if k.startswith("5")),
        "hangs_or_transport_errors": statuses.get("None", 0),
        "non_openai_errors": sum("OpenAI" in p["problem"] or "event" in p["problem"] for p in problems),
        "problems": problems[:20], "slowest_case_s": round(slowest, 2), "kv_leak": not is_idle(idle),
        "hostile_cases": hostile["cases"], "hostile_problems": hostile["problems"],
        "seconds": round(time.monotonic() - t_start, 1), "loadavg_at_end": os.getloadavg()[0],
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: a tiny llama built into a temp dir)")
    p.add_argument("--num-cases", type=int, default=1000, help="generated cases to send, at least")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=30.0, help="seconds per request before it counts as hung")
    p.add_argument("--out", default=DEFAULT_OUT)
    a = p.parse_args(argv)
    summary = run_fuzz(a.model, a.num_cases, a.seed, a.timeout)
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(summary, f, indent=1)
    print(json.dumps({k: v for k, v in summary.items() if k != "problems"}, indent=1))
    for prob in summary["problems"]:
        print(f"{prob['operation']}: {prob['problem']}\n  {prob['curl']}")
    print(f"wrote {a.out}")
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
