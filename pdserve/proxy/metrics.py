"""The proxy's own Prometheus metrics (the workers keep theirs): requests by outcome, the time of
each phase as the proxy sees it, and the requests in flight on each worker."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pdserve.proxy.workers import Pool
from pdserve.server.metrics import LATENCY_BUCKETS, REQUEST_BUCKETS

# How a request through the proxy ended (docs/API.md, "Disaggregated serving").
OUTCOMES = ("success", "client_error", "worker_error", "unavailable", "timeout", "broken", "cancelled")


class ProxyMetrics:
    def __init__(self, model_name: str, pools: list[Pool]):
        self.registry = r = CollectorRegistry()
        self.model_name = model_name

        def hist(name, doc, buckets):
            return Histogram(f"pdserve:proxy_{name}", doc, ["model_name"], buckets=buckets,
                             registry=r).labels(model_name)

        self.requests = Counter("pdserve:proxy_requests", "Requests through the proxy, by endpoint and outcome.",
                                ["model_name", "endpoint", "outcome"], registry=r)
        self.prefill = hist("prefill_seconds", "The prefill worker's call: sent to its answer (KV held).",
                            LATENCY_BUCKETS)
        self.decode_ttft = hist("decode_ttft_seconds", "Streams: the decode worker's call sent to its first "
                                "token (the KV transfer included).", LATENCY_BUCKETS)
        self.ttft = hist("time_to_first_token_seconds", "Streams: arrival at the proxy to the first token.",
                         LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival at the proxy to the end of the answer.",
                        REQUEST_BUCKETS)
        in_flight = Gauge("pdserve:proxy_worker_in_flight", "Requests this proxy has in flight on each worker.",
                          ["model_name", "role", "worker"], registry=r)
        for pool in pools:   # read at each scrape
            for w in pool.workers:
                in_flight.labels(model_name, w.role, w.url).set_function(lambda p=pool, w=w: p.in_flight(w))

    def outcome(self, endpoint: str, outcome: str) -> None:
        self.requests.labels(self.model_name, endpoint, outcome).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
