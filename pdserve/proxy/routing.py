"""Which worker of a role gets the next request: round-robin, or the one with the fewest
requests in flight at this proxy (ties in round-robin order, so idle workers take turns)."""
import contextlib

import httpx

ROUTINGS = ("round-robin", "least-loaded")


def worker_url(text: str) -> str:
    """A worker's base URL from what the user typed: `host:port` gets http://, a trailing `/v1`
    or `/` goes (the proxy adds the paths)."""
    text = text.strip()
    if "://" not in text:
        text = "http://" + text
    try:
        url = httpx.URL(text)
    except httpx.InvalidURL as e:
        raise ValueError(f"not a URL: {text!r} ({e})") from None
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"not an http(s) URL with a host: {text!r}")
    return str(url.copy_with(path=url.path.rstrip("/").removesuffix("/v1") or "/", query=None)).rstrip("/")


class Worker:
    def __init__(self, url: str, role: str):
        self.url, self.role = url, role
        self.in_flight = 0   # requests this proxy has sent it that have not finished
        self.engine_id: str | None = None   # its id on the KV channel (set by the pairing check)

    def __repr__(self) -> str:
        return f"{self.role} worker {self.url}"


class Router:
    def __init__(self, workers: list[Worker], routing: str = "round-robin"):
        if not workers:
            raise ValueError("a router needs at least one worker")
        if routing not in ROUTINGS:
            raise ValueError(f"routing must be one of {ROUTINGS}, got {routing!r}")
        self.workers, self.routing = workers, routing
        self._next = 0

    def choose(self) -> Worker:
        n = len(self.workers)
        order = [self.workers[(self._next + i) % n] for i in range(n)]
        self._next = (self._next + 1) % n
        if self.routing == "least-loaded":
            return min(order, key=lambda w: w.in_flight)   # the first of the least loaded
        return order[0]

    @contextlib.contextmanager
    def busy(self, worker: Worker):
        """Counts a request in flight on `worker` for as long as the block runs."""
        worker.in_flight += 1
        try:
            yield worker
        finally:
            worker.in_flight -= 1
