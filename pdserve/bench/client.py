"""The client side of a benchmark: when requests are sent, and what one streamed request saw
(a token's arrival times, usage, errors). Shared by `pdserve bench` (serve_bench.py) and its
multi-turn mode (multi_turn.py)."""
import contextlib
import json
import math
import time

import httpx
import numpy as np

from pdserve.bench.bench_metrics import RequestResult


def arrival_offsets(n: int, rate: float, burstiness: float, seed) -> list[float]:
    """Send times (s after the start) of n requests: the first at 0, then Gamma gaps with shape
    `burstiness` and mean 1/rate (burstiness 1 = Poisson arrivals; lower = burstier). rate inf:
    all at 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"--request-rate and --burstiness must be positive, got {rate} and {burstiness}")
    if math.isinf(rate):
        return [0.0] * n
    gaps = np.random.default_rng(seed).gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=max(n - 1, 0))
    return [0.0, *np.cumsum(gaps).tolist()][:n]


class StreamRecorder:
    """Timestamps the server-sent events of one streamed completion."""

    def __init__(self, sent: float):
        self.sent = sent
        self.first: float | None = None   # first chunk carrying a token
        self.last: float | None = None
        self.itl: list[float] = []
        self.usage: dict | None = None
        self.error = ""
        self.pieces: list[str] = []

    def feed(self, line: str, now: float) -> bool:
        """Take one line of the stream received at `now`; False once the stream is over."""
        if not line.startswith("data:"):
            return True   # event separators, `: ping` comments
        data = line[5:].strip()
        if data == "[DONE]":
            return False
        try:
            event = json.loads(data)
        except ValueError:
            self.error = f"unparsable event: {data[:200]}"
            return False
        if "error" in event:
            err = event["error"]
            self.error = "error event: " + (err.get("message", str(err)) if isinstance(err, dict) else str(err))
            return False
        if event.get("usage"):   # some servers repeat it on every chunk: the last one is the total
            self.usage = event["usage"]
        if (choices := event.get("choices")) and self.takes(choices[0]):   # a token chunk, even if its text is empty
            if self.first is None:
                self.first = now
            else:
                self.itl.append(now - self.last)
            self.last = now
            self.pieces.append(self.text_of(choices[0]))
            if choices[0].get("finish_reason") == "error":
                self.error = "the server failed the request (finish_reason: error)"
                return False
        return True

    def takes(self, choice: dict) -> bool:
        """Whether this chunk's choice carries a token (a completion chunk always does)."""
        return True

    def text_of(self, choice: dict) -> str:
        return choice.get("text") or ""

    @property
    def text(self) -> str:
        """The answer so far, as streamed."""
        return "".join(self.pieces)

    def result(self, prompt_len: int | None) -> RequestResult:
        error = self.error
        if not error and self.first is None:
            error = "the stream ended without a token"
        if not error and not (self.usage and isinstance(self.usage.get("completion_tokens"), int)):
            error = "no usage.completion_tokens in the stream (does the server support stream_options.include_usage?)"
        if error:
            return RequestResult(prompt_len=prompt_len, error=error)
        details = self.usage.get("prompt_tokens_details")   # OpenAI's; absent from some servers
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return RequestResult(prompt_len=self.usage.get("prompt_tokens", prompt_len),
                             output_tokens=self.usage["completion_tokens"], ttft=self.first - self.sent,
                             itl=self.itl, latency=self.last - self.sent, success=True,
                             cached_tokens=cached if isinstance(cached, int) else None, text=self.text)


async def stream_post(client: httpx.AsyncClient, url: str, payload: dict, headers: dict,
                      rec: StreamRecorder) -> StreamRecorder:
    """POST a streamed request and feed its events to `rec`; a failure becomes rec.error."""
    try:
        async with client.stream("POST", url, json=payload, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode(errors="replace")
                with contextlib.suppress(ValueError, AttributeError, TypeError):
                    text = json.loads(text)["error"]["message"]
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
            else:
                async for line in resp.aiter_lines():
                    if not rec.feed(line, time.perf_counter()):
                        break
    except Exception as e:   # connection refused or reset, timeout, broken stream: a failed request
        rec.error = f"{type(e).__name__}: {e}"
    return rec
