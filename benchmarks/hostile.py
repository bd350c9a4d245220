"""Hostile clients for the reliability scripts (fuzz.py, soak.py, overload.py): requests that
must be refused (text that is not Unicode, bodies not sent as JSON, a foreign Host, two
Authorization headers, integers given as booleans, prompts too long to tokenize, requests
that would cost too much) and clients that are too slow to be served (slowloris).

    python -m benchmarks.hostile --url http://127.0.0.1:8000     # the refusal checks against a server

`check_refusals(url)` sends every case on one keep-alive connection and returns what went
wrong (empty if nothing): a wrong status, a body not in OpenAI's error format, or a refusal
that closed the connection. `slow_clients(...)` measures how long the server lets slow
clients hold a connection.
"""
import argparse
import asyncio
import json
import socket
import sys
import time
import urllib.parse

CHAT = [{"role": "user", "content": "hi"}]
# (name, path, raw body, extra headers, expected status); the body is sent as application/json
# unless the headers say otherwise. 900 KB prompts are refused by their length, before tokenizing.
CASES = [
    ("surrogate in prompt", "/v1/completions", '{"prompt": "a\\ud800", "max_tokens": 2}', {}, 400),
    ("surrogate in model", "/v1/completions", '{"prompt": "a", "model": "\\udfff"}', {}, 400),
    ("surrogate in stop", "/v1/completions", '{"prompt": "a", "stop": "\\ud83d"}', {}, 400),
    ("surrogate in chat", "/v1/chat/completions", '{"messages": [{"role": "user", "content": "\\ud800"}]}', {}, 400),
    ("surrogate in /generate", "/generate", '{"prompts": ["\\udc00"]}', {}, 400),
    ("surrogate in /generate_stream", "/generate_stream", '{"prompt": "\\udc00"}', {}, 400),
    ("surrogate in /basic_generate", "/basic_generate", '{"prompt": "\\udc00"}', {}, 400),
    ("surrogate in /tokenize", "/tokenize", '{"prompt": "\\ud800"}', {}, 400),
    ("surrogate in a key", "/detokenize", '{"tokens": [1], "\\ud800": 0}', {}, 400),
    ("no content type", "/v1/completions", '{"prompt": "a"}', {"Content-Type": None}, 415),
    ("form post", "/v1/completions", '{"prompt": "a"}', {"Content-Type": "application/x-www-form-urlencoded"}, 415),
    ("text/plain", "/v1/chat/completions", json.dumps({"messages": CHAT}), {"Content-Type": "text/plain"}, 415),
    ("foreign Host", "/v1/models", None, {"Host": "rebound.example"}, 400),
    ("boolean as n", "/v1/completions", '{"prompt": "a", "n": true}', {}, 400),
    ("string as max_tokens", "/v1/completions", '{"prompt": "a", "max_tokens": "5"}', {}, 400),
    ("top_logprobs -1", "/v1/chat/completions",
     json.dumps({"messages": CHAT, "logprobs": True, "top_logprobs": -1}), {}, 400),
    ("900 KB prompt", "/v1/completions", json.dumps({"prompt": "word " * 180_000}), {}, 400),
    ("900 KB chat", "/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "w " * 450_000}]}),
     {}, 400),
    ("amplification", "/v1/completions",
     json.dumps({"prompt": "a", "n": 64, "max_tokens": 200, "logprobs": 20}), {}, 400),
    ("amplification (chat)", "/v1/chat/completions",
     json.dumps({"messages": CHAT, "n": 64, "max_tokens": 200, "logprobs": True, "top_logprobs": 20}), {}, 400),
]


def _request(host: str, method: str, path: str, body: str | None, headers: dict) -> bytes:
    data = (body or "").encode("utf-8", "surrogatepass")
    h = {"Host": host, "Content-Type": "application/json", "Content-Length": str(len(data)), **headers}
    if body is None and method == "GET":
        h.pop("Content-Length"), h.pop("Content-Type")
    lines = [f"{method} {path} HTTP/1.1"] + [f"{k}: {v}" for k, v in h.items() if v is not None]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + data


def _read_response(sock: socket.socket) -> tuple[int, dict, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed by the server")
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        body += chunk
    return int(lines[0].split()[1]), headers, body


def _openai_error(body: bytes) -> bool:
    try:
        err = json.loads(body)["error"]
    except (ValueError, KeyError, TypeError):
        return False
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"} and bool(err["message"])


def check_refusals(url: str, api_key: str | None = None) -> dict:
    """Every case on one keep-alive connection: {"statuses": {name: status}, "problems": [...]}."""
    u = urllib.parse.urlsplit(url)
    host = u.netloc
    statuses, problems = {}, []
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sock = socket.create_connection((u.hostname, u.port))
    sock.settimeout(60)
    try:
        for name, path, body, headers, expected in CASES:
            method = "GET" if body is None else "POST"
            sock.sendall(_request(host, method, path, body, {**auth, **headers}))
            try:
                status, resp_headers, resp_body = _read_response(sock)
            except (ConnectionError, TimeoutError) as e:
                problems.append(f"{name}: {e}")
                sock.close()
                sock = socket.create_connection((u.hostname, u.port))
                continue
            statuses[name] = status
            if status != expected:
                problems.append(f"{name}: HTTP {status}, expected {expected}: {resp_body[:200]!r}")
            elif not _openai_error(resp_body):
                problems.append(f"{name}: HTTP {status} not in OpenAI's error format: {resp_body[:200]!r}")
            if resp_headers.get("connection", "").lower() == "close":
                problems.append(f"{name}: the refusal closed the keep-alive connection")
        # and the connection still serves a good request
        sock.sendall(_request(host, "GET", "/health", None, {}))
        if _read_response(sock)[0] != 200:
            problems.append("/health on the same connection afterwards is not 200")
    except (ConnectionError, TimeoutError) as e:
        problems.append(f"the connection failed: {e}")
    finally:
        sock.close()
    return {"cases": len(CASES), "statuses": statuses, "problems": problems}


async def _slow_client(host: str, port: int, kind: str, give_up: float) -> float | None:
    """Seconds until the server closed a slow connection (None: still open after `give_up`)."""
    reader, writer = await asyncio.open_connection(host, port)
    t0 = time.perf_counter()
    try:
        if kind == "body":
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                         "Content-Length: 1000\r\n\r\n{".encode())
        else:
            writer.write(f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n".encode())
        while time.perf_counter() - t0 < give_up:
            try:
                if not await asyncio.wait_for(reader.read(4096), 1.0):
                    return time.perf_counter() - t0
            except asyncio.TimeoutError:
                pass
            writer.write(b"x" if kind == "body" else b"X-Slow: 1\r\n")   # a byte a second keeps it "active"
            try:
                await writer.drain()
            except ConnectionError:
                return time.perf_counter() - t0
        return None
    except ConnectionError:
        return time.perf_counter() - t0
    finally:
        writer.close()


async def slow_clients(url: str, count: int, give_up: float = 60.0) -> dict:
    """`count` slowloris connections, half trickling headers, half a body: when each was cut off."""
    u = urllib.parse.urlsplit(url)
    kinds = ["headers", "body"] * (count // 2) + ["headers"] * (count % 2)
    closed = await asyncio.gather(*(_slow_client(u.hostname, u.port, k, give_up) for k in kinds))
    cut = sorted(c for c in closed if c is not None)
    return {"clients": count, "still_open_after_s": give_up if None in closed else None,
            "still_open": sum(c is None for c in closed), "cut_off": len(cut),
            "cut_off_after_s": {"min": cut[0], "max": cut[-1]} if cut else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--url", default="http://127.0.0.1:8000")
    p.add_argument("--api-key", default=None)
    p.add_argument("--slow-clients", type=int, default=20)
    p.add_argument("--give-up", type=float, default=60.0, help="seconds after which a slow client counts as never cut")
    a = p.parse_args(argv)
    refusals = check_refusals(a.url, a.api_key)
    slow = asyncio.run(slow_clients(a.url, a.slow_clients, a.give_up))
    print(json.dumps({"refusals": refusals, "slow_clients": slow}, indent=1))
    return 0 if not refusals["problems"] and not slow["still_open"] else 1


if __name__ == "__main__":
    sys.exit(main())
