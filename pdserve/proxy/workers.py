"""The proxy's workers: their URLs, and the pool of each role with the router that chooses the
worker of a request (pdserve/routing.py: round-robin, least-loaded, prefix-aware)."""
import contextlib

import httpx

from pdserve.routing import Router


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
        self.engine_id: str | None = None   # its id on the KV channel (set by the pairing check)

    def __repr__(self) -> str:
        return f"{self.role} worker {self.url}"


class Pool:
    """The workers of one role and the router that chooses among them (pdserve/routing.py), which
    counts the requests this proxy has in flight on each."""

    def __init__(self, workers: list[Worker], router: Router):
        if not workers:
            raise ValueError("a pool needs at least one worker")
        self.workers, self.router = workers, router

    def choose(self, hashes: list[int] = ()) -> Worker:
        """The worker for a request whose prompt has these block hashes ([]: not routed by prefix)."""
        worker, _ = self.router.choose(self.workers, hashes)
        self.router.record(worker, hashes)
        return worker

    def in_flight(self, worker: Worker) -> int:
        return self.router.in_flight.get(worker, 0)

    @contextlib.contextmanager
    def busy(self, worker: Worker):
        """Counts a request in flight on `worker` for as long as the block runs."""
        self.router.sent(worker)
        try:
            yield worker
        finally:
            self.router.completed(worker)
