"""`pdserve perplexity`: the perplexity of a served model over a text file, through the server's
OpenAI API (any server with /tokenize and completions' echo + logprobs: pdserve, vLLM).

The file is tokenized once (POST /tokenize), then scored in windows of at most --max-length tokens
that start --stride tokens apart, as transformers' perplexity guide defines them: each window
scores only the tokens the previous window did not (its last `end - previous end`), each given
the whole window before it; a window's first token has no context and is not scored. A
window is one `/v1/completions` request with the window's token ids, echo, logprobs 0 and
max_tokens 0: the server returns every prompt token's logprob and generates nothing.

    NLL = -(sum of the scored tokens' logprobs) / tokens scored,  perplexity = exp(NLL)"""
import argparse
import json
import math
import os
from concurrent.futures import ThreadPoolExecutor

import httpx

from pdserve.errors import RequestError


def windows(num_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored) of each window over tokens [0, num_tokens): transformers' loop,
    where a window scores its last end - previous_end tokens, never its own first (with stride ==
max_length, each window's first token is so left unscored, as there)."""
    out, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        out.append((begin, end, max(begin + 1, prev_end)))
        prev_end = end
        if end == num_tokens:
            break
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("file", help="the text file (UTF-8) to score")
    parser.add_argument("--base-url", default="http://127.0.0.1:8000",
                        help="the server, without /v1 (default: %(default)s)")
    parser.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    parser.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"),
                        help="sent as `Authorization: Bearer KEY` (default: $OPENAI_API_KEY)")
    parser.add_argument("--max-length", type=int, default=None,
                        help="tokens per window (default: the server's max_model_len - 1: a scored prompt "
                             "leaves room for the one token the server runs)")
    parser.add_argument("--stride", type=int, default=None,
                        help="tokens between window starts; smaller scores each token with more context, "
                             "in more requests (default: max-length / 2)")
    parser.add_argument("--concurrency", type=int, default=4, help="windows in flight at once (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds per request (default: %(default)s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of lines")


def run(args: argparse.Namespace) -> int:
    with open(args.file, encoding="utf-8") as f:
        text = f.read()
    base = args.base_url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=base, headers=headers, timeout=args.timeout) as client:
        try:
            result = perplexity(client, text, args.model, args.max_length, args.stride, args.concurrency)
        except httpx.HTTPError as e:   # the server is not there, or went away
            raise RequestError(f"{base}: {e}") from None
    if args.json:
        print(json.dumps(result))
    else:
        print(f"model:         {result['model']}")
        print(f"windows:       {result['windows']} (max length {result['max_length']}, stride {result['stride']})")
        print(f"tokens scored: {result['tokens']}")
        print(f"mean NLL:      {result['mean_nll']:.6f}")
        print(f"perplexity:    {result['perplexity']:.4f}")
    return 0


def _post(client: httpx.Client, path: str, body: dict) -> dict:
    r = client.post(path, json=body)
    if r.status_code != 200:
        try:
            why = r.json()["error"]["message"]
        except Exception:
            why = r.text[:500]
        raise RequestError(f"{path} answered {r.status_code}: {why}")
    return r.json()


def perplexity(client: httpx.Client, text: str, model: str | None = None, max_length: int | None = None,
               stride: int | None = None, concurrency: int = 4) -> dict:
    if model is None:
        r = client.get("/v1/models")
        r.raise_for_status()
        model = r.json()["data"][0]["id"]
    tok = _post(client, "/tokenize", {"model": model, "prompt": text})
    ids = tok["tokens"]
    if max_length is None:
        max_length = tok["max_model_len"] - 1
    stride = max_length // 2 if stride is None else stride
    if max_length < 2 or not 1 <= stride <= max_length:
        raise RequestError(f"--max-length must be >= 2 and --stride in [1, max-length], got {max_length} and {stride}")
    if len(ids) < 2:
        raise RequestError(f"the file has {len(ids)} token(s): at least 2 are needed to score one")
    spans = windows(len(ids), max_length, stride)

    def score(span) -> tuple[float, int]:
        begin, end, first = span
        body = {"model": model, "prompt": ids[begin:end], "echo": True, "logprobs": 0, "max_tokens": 0,
                "temperature": 0}
        lps = _post(client, "/v1/completions", body)["choices"][0]["logprobs"]["token_logprobs"]
        if len(lps) != end - begin:
            raise RequestError(f"/v1/completions echoed {len(lps)} logprobs for a window of {end - begin} tokens")
        return sum(lps[first - begin:]), end - first

    with ThreadPoolExecutor(max(1, concurrency)) as pool:
        parts = list(pool.map(score, spans))
    scored = sum(n for _, n in parts)
    nll = -sum(lp for lp, _ in parts) / scored
    return {"model": model, "tokens": scored, "mean_nll": nll, "perplexity": math.exp(nll), "windows": len(spans),
            "max_length": max_length, "stride": stride}
