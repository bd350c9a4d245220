"""Prometheus metrics, named after vLLM's under a `pdserve:` prefix.

Each app owns its CollectorRegistry (not prometheus_client's global one), so a process, or a
test, can build several apps. Everything is recorded from the engine thread after each step:
per-step histograms from engine.last_step, request histograms when a request finishes,
gauges from engine.get_stats(). prometheus_client is thread-safe.
"""
import dataclasses
import json
import logging
import os
import time

from prometheus_client import (CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram,
                               disable_created_metrics, generate_latest)

from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
from pdserve.backends.cpu.kernels import pool_cached_bytes

LATENCY_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
                   1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0]
TOKEN_BUCKETS = [0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192]
SEQ_BUCKETS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]

CONTENT_TYPE = CONTENT_TYPE_LATEST
# No `_created` series beside every counter and histogram (process-wide, as vLLM does).
disable_created_metrics()
LOG_INTERVAL_S = 10.0   # the periodic engine log, as vLLM's: only after intervals in which steps ran

log = logging.getLogger("pdserve.engine")


class ServerMetrics:
    def __init__(self, step_log: str | None = None, model_name: str = "pdserve"):
        self.registry = r = CollectorRegistry()
        self._last_step: StepStats | None = None
        # line-buffered: a crash or SIGKILL still leaves every finished step on disk
        self._step_log = open(step_log, "a", buffering=1) if step_log else None
        self._pid = os.getpid()   # in each line: engines that share a log (Ray replicas) tell their steps apart
        self.model_name = model_name

        # every series carries vLLM's model_name label, so dashboards built for vLLM work
        def hist(name, doc, buckets):
            return Histogram(f"pdserve:{name}", doc, ["model_name"], buckets=buckets, registry=r).labels(model_name)

        def counter(name, doc, labels=()):
            c = Counter(f"pdserve:{name}", doc, ["model_name", *labels], registry=r)
            return c if labels else c.labels(model_name)

        def gauge(name, doc):
            return Gauge(f"pdserve:{name}", doc, ["model_name"], registry=r).labels(model_name)

        # per request, observed when it finishes
        self.ttft = hist("time_to_first_token_seconds", "Arrival to first generated token.", LATENCY_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Gap between consecutive generated tokens.", LATENCY_BUCKETS)
        self.tpot = hist("request_time_per_output_token_seconds",
                         "Mean time per output token after the first, per request.", LATENCY_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = hist("request_queue_time_seconds", "Arrival to first scheduled.", REQUEST_BUCKETS)
        self.prefill_time = hist("request_prefill_time_seconds", "First scheduled to first token.", REQUEST_BUCKETS)
        self.decode_time = hist("request_decode_time_seconds", "First token to finish.", REQUEST_BUCKETS)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests.")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests.")
        self.preemptions = counter("num_preemptions", "Sequences preempted (KV blocks reclaimed) by the scheduler.")
        self.success = counter("request_success", "Finished requests by finish reason.", ["finished_reason"])
        # vLLM's, in tokens: prompt tokens looked up in the prefix cache at admission, and found
        self.cache_queries = counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.cache_hits = counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self._cache_seen = (0, 0)
        # speculative decoding (vLLM's names): verifications, drafts proposed, drafts accepted
        self.spec_drafts = counter("spec_decode_num_drafts", "Speculative verifications (one per sequence and step).")
        self.spec_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed and verified.")
        self.spec_accepted = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.spec_accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                             "Draft tokens accepted, by their position among the drafts.",
                                             ["position"])
        self._spec_seen = [0, 0, 0, []]
        # prefill/decode roles: KV bytes this worker sent (prefill) or pulled (decode), and the time it took
        self.kv_bytes = counter("kv_transfer_bytes", "Bytes of prompt KV cache moved to or from another worker.")
        self.kv_seconds = counter("kv_transfer_seconds", "Seconds spent moving prompt KV cache (sum over transfers).")
        self.kv_transfers = counter("kv_transfers", "Prompt KV transfers completed.")
        self.kv_failures = counter("kv_transfer_failures", "Prompt KV transfers that failed.")
        self.kv_leases = gauge("kv_leases", "Finished requests whose prompt blocks are kept for a decode worker.")
        # CPU: the forward's thread count, where the engine adapts it (engine/threads.py)
        self.cpu_threads = gauge("cpu_threads", "Threads of the CPU forward now (fewer while other work takes "
                                 "cores; 0: fixed by --threads or not on CPU).")
        self.cpu_thread_changes = counter("cpu_thread_changes", "Changes of the CPU forward's thread count.")
        self._thread_changes_seen = 0
        self._kv_seen = (0, 0.0, 0, 0)
        self._window = [time.monotonic(), 0, 0, 0, 0]   # start, prefill and decode tokens, cache queries, hits
        # objectives (docs/API.md): attainment per phase; the rate of request_goodput is goodput
        self.slo_requests = counter("request_slo", "Finished requests with a target for the phase (aborts "
                                    "left out).", ["phase"])
        self.slo_attained = counter("request_slo_attained", "Finished requests that met their target for "
                                    "the phase.", ["phase"])
        self.goodput = counter("request_goodput", "Finished requests with targets that met all of them.")
        # engine state after the latest step
        self.running = gauge("num_requests_running", "Requests in the running batch.")
        self.waiting = gauge("num_requests_waiting", "Requests admitted but not yet scheduled.")
        self.kv_usage = gauge("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).")
        # read at each scrape: memory the CPU kernels keep besides weights and KV cache (up to 1 GiB)
        gauge("cpu_kernel_pool_bytes", "Bytes of freed big kernel outputs kept for reuse.").set_function(
            pool_cached_bytes)
        # per step
        self.step_prefill = hist("step_prefill_tokens", "Prefill tokens in one engine step.", TOKEN_BUCKETS)
        self.step_decode = hist("step_decode_tokens", "Decode tokens in one engine step.", TOKEN_BUCKETS)
        self.step_seqs = hist("step_num_seqs", "Sequences in one engine step.", SEQ_BUCKETS)
        self.step_time = hist("step_duration_seconds", "Wall time of one engine step.", LATENCY_BUCKETS)

    def record_step(self, step: StepStats | None, stats: EngineStats, outputs: list[RequestOutput]) -> None:
        # A step that only delivered aborts leaves engine.last_step as it was: count each step once.
        if step is not None and step is not self._last_step:
            self._last_step = step
            self.step_prefill.observe(step.num_prefill_tokens)
            self.step_decode.observe(step.num_decode_tokens)
            self.step_seqs.observe(step.num_seqs)
            self.step_time.observe(step.duration)
            if step.num_preemptions:
                self.preemptions.inc(step.num_preemptions)
            if self._step_log is not None:
                self._step_log.write(json.dumps({**dataclasses.asdict(step), "pid": self._pid}) + "\n")
            self._window[1] += step.num_prefill_tokens
            self._window[2] += step.num_decode_tokens
        self.running.set(stats.num_running)
        self.waiting.set(stats.num_waiting)
        self.kv_usage.set(stats.kv_cache_usage)
        queries, hits = stats.prefix_cache_queries - self._cache_seen[0], stats.prefix_cache_hits - self._cache_seen[1]
        if queries:
            self.cache_queries.inc(queries)
            self.cache_hits.inc(hits)
            self._cache_seen = (stats.prefix_cache_queries, stats.prefix_cache_hits)
            self._window[3] += queries
            self._window[4] += hits
        if stats.spec_decode is not None:
            self._record_spec(stats.spec_decode)
        kv = (stats.kv_transfer_bytes, stats.kv_transfer_seconds, stats.kv_transfers, stats.kv_transfer_failures)
        if kv != self._kv_seen:
            for c, now, seen in zip((self.kv_bytes, self.kv_seconds, self.kv_transfers, self.kv_failures), kv,
                                    self._kv_seen):
                if now > seen:
                    c.inc(now - seen)
            self._kv_seen = kv
        self.kv_leases.set(stats.kv_leases)
        self.cpu_threads.set(stats.cpu_threads)
        if stats.cpu_thread_changes > self._thread_changes_seen:
            self.cpu_thread_changes.inc(stats.cpu_thread_changes - self._thread_changes_seen)
            self._thread_changes_seen = stats.cpu_thread_changes
        if time.monotonic() - self._window[0] >= LOG_INTERVAL_S:
            self._log_window(stats)
        for out in outputs:
            if out.finished:
                self.record_finished(out)

    def _record_spec(self, spec) -> None:
        seen = self._spec_seen
        if spec.num_drafts == seen[0]:
            return
        self.spec_drafts.inc(spec.num_drafts - seen[0])
        self.spec_draft_tokens.inc(spec.num_draft_tokens - seen[1])
        self.spec_accepted.inc(spec.num_accepted_tokens - seen[2])
        before = seen[3] or [0] * len(spec.accepted_per_pos)
        for pos, (now, was) in enumerate(zip(spec.accepted_per_pos, before)):
            if now > was:
                self.spec_accepted_per_pos.labels(self.model_name, str(pos)).inc(now - was)
        self._spec_seen = [spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                           list(spec.accepted_per_pos)]

    def _log_window(self, stats: EngineStats) -> None:
        start, prefill, decode, queries, hits = self._window
        now = time.monotonic()
        if prefill or decode:   # the hit rate over the admissions of the interval, if there were any
            rate = f"{100 * hits / queries:.1f}%" if queries else "n/a (no admissions)"
            log.info("engine: %.1f prefill tok/s, %.1f decode tok/s; running %d, waiting %d; KV cache usage %.1f%%; "
                     "prefix cache hit rate %s", prefill / (now - start), decode / (now - start),
                     stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage, rate)
        self._window = [now, 0, 0, 0, 0]

    def record_finished(self, out: RequestOutput) -> None:
        m = out.metrics
        self.success.labels(self.model_name, out.finish_reason or "unknown").inc()
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.generation_tokens.inc(len(out.token_ids))
        for hist, value in ((self.ttft, m.ttft), (self.tpot, m.tpot), (self.e2e, m.e2e),
                            (self.queue_time, m.queue_time), (self.prefill_time, m.prefill_time),
                            (self.decode_time, m.decode_time)):
            if value is not None:   # e.g. a request aborted before its first token has no TTFT
                hist.observe(value)
        for gap in m.itl:
            self.itl.observe(gap)
        if out.finish_reason != "abort" and (m.ttft_target is not None or m.tpot_target is not None):
            good = True
            for phase, target, attained in (("ttft", m.ttft_target, m.ttft_attained),
                                            ("tpot", m.tpot_target, m.tpot_attained)):
                if target is None:
                    continue
                self.slo_requests.labels(self.model_name, phase).inc()
                if attained:   # None (e.g. failed before its first token) is a miss
                    self.slo_attained.labels(self.model_name, phase).inc()
                else:
                    good = False
            if good:
                self.goodput.inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
