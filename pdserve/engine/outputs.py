"""What the engine hands back: per-request outputs with phase timings, and per-step stats."""
from dataclasses import dataclass, field


@dataclass(slots=True)   # one per request, touched every step: no dict
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    num_prefill_steps: int = 0      # steps that carried part of its (re-)prefill
    num_preemptions: int = 0
    num_cached_tokens: int = 0      # prompt tokens found in the prefix cache at its first admission
    ttft_target: float | None = None   # seconds; the request's objectives with the engine's defaults
    tpot_target: float | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time

    @property
    def prefill_time(self) -> float | None:
        if self.first_token_time is None or self.first_scheduled_time is None:
            return None
        return self.first_token_time - self.first_scheduled_time

    @property
    def decode_time(self) -> float | None:
        if self.finished_time is None or self.first_token_time is None:
            return None
        return self.finished_time - self.first_token_time

    @property
    def itl(self) -> list[float]:
        """Gaps between consecutive generated tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def tpot(self) -> float | None:
        """(e2e - TTFT) / (n - 1): mean time per output token after the first."""
        n = len(self.token_times)
        if n < 2 or self.finished_time is None:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (n - 1)

    @property
    def ttft_attained(self) -> bool | None:
        """Whether the first token came within the TTFT target (None: no target, or no token)."""
        if self.ttft_target is None or self.first_token_time is None:
            return None
        return self.ttft <= self.ttft_target

    @property
    def tpot_attained(self) -> bool | None:
        """Whether the finished request's TPOT met its target; one output token counts as TPOT 0
        (as vLLM's goodput does)."""
        if self.tpot_target is None or self.finished_time is None or not self.token_times:
            return None
        tpot = self.tpot
        return tpot is None or tpot <= self.tpot_target

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e, "queue_time_s": self.queue_time,
                "prefill_time_s": self.prefill_time, "decode_time_s": self.decode_time,
                "num_prefill_steps": self.num_prefill_steps, "num_preemptions": self.num_preemptions,
                "num_cached_tokens": self.num_cached_tokens,
                "slo_ttft_attained": self.ttft_attained, "slo_tpot_attained": self.tpot_attained}


@dataclass(slots=True)
class Logprob:
    """One entry of a prompt logprobs dict (vLLM's Logprob): the log-probability of a token, its
    rank in the model's distribution at that position (1: the most likely) and its text."""
    logprob: float
    rank: int
    decoded_token: str | None = None


class ListPrefix:
    """items[start:stop] of a list that only ever grows (a sequence's token ids, its logprobs),
    copied when first read rather than when made. The engine makes an output for every request
    in every step, and most are never read whole: copying the list each time made a request's
    outputs cost O(length^2)."""
    __slots__ = ("items", "start", "stop")

    def __init__(self, items: list, start: int, stop: int):
        self.items, self.start, self.stop = items, start, stop


def _copied(value):
    """A ListPrefix's items as a list (anything else as it is)."""
    return value.items[value.start:value.stop] if type(value) is ListPrefix else value


class RequestOutput:
    """The state of one request after a step. `new_*` is what this output adds to the request's
    previous one: this step's token, or everything for a final_only request (its only output).

    A plain class with slots, not a dataclass: the engine makes one per streamed request in every
    step, on caches the forward has just flushed, and a slotted object is one allocation with no
    dict (making one took 0.50 us warm as a dataclass with copy-on-read fields, 0.25 us so)."""
    __slots__ = ("request_id", "prompt_token_ids", "_token_ids", "text", "new_token_ids", "new_text", "_logprobs",
                 "finished", "finish_reason", "metrics", "stop_reason", "kv_transfer_params", "error",
                 "prompt_logprobs")

    def __init__(self, request_id: str, prompt_token_ids: list[int], token_ids: "list[int] | ListPrefix", text: str,
                 new_token_ids: list[int], new_text: str, logprobs: "list[dict[int, float]] | ListPrefix | None",
                 finished: bool, finish_reason: str | None, metrics: RequestMetrics,
                 stop_reason: str | int | None = None, kv_transfer_params: dict | None = None):
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids   # shared by all outputs of the request: do not mutate
        self._token_ids = token_ids        # all generated so far (a ListPrefix until read)
        self.text = text                   # all generated text so far (stop string removed)
        self.new_token_ids = new_token_ids
        self.new_text = new_text
        self._logprobs = logprobs          # per generated token so far: {token_id: logprob}, sampled one
        # included; None unless the request asked for logprobs (a ListPrefix until read)
        self.finished = finished
        self.finish_reason = finish_reason   # "stop" (EOS, stop string or stop token), "length", "abort", "error"
        self.metrics = metrics
        self.stop_reason = stop_reason     # the stop string or stop token id that ended it, if any
        # a prefill worker's final output: where a decode worker pulls its prompt KV from (or {"error": ...})
        self.kv_transfer_params = kv_transfer_params
        self.error = None   # finish_reason "error" by the request's own fault: a RequestError saying why
        # SamplingParams.prompt_logprobs: one {token_id: Logprob} per prompt token, the first None
        # (complete from the first output on); None unless asked for. Shared: do not mutate.
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = None

    @property
    def token_ids(self) -> list[int]:
        self._token_ids = v = _copied(self._token_ids)   # the copy, made on the first read, is kept
        return v

    @property
    def logprobs(self) -> list[dict[int, float]] | None:
        self._logprobs = v = _copied(self._logprobs)
        return v

    @property
    def new_logprobs(self) -> list[dict[int, float]] | None:
        """Logprobs of this step's new tokens."""
        return None if self.logprobs is None else self.logprobs[len(self.logprobs) - len(self.new_token_ids):]

    @property
    def num_cached_tokens(self) -> int:
        """Prompt tokens whose K/V came from the prefix cache (vLLM's RequestOutput field)."""
        return self.metrics.num_cached_tokens

    def __repr__(self):
        return (f"RequestOutput({self.request_id!r}, token_ids={self.token_ids}, text={self.text!r}, "
                f"new_token_ids={self.new_token_ids}, new_text={self.new_text!r}, finished={self.finished}, "
                f"finish_reason={self.finish_reason!r}, stop_reason={self.stop_reason!r})")


@dataclass
class StepStats:
    """One engine step, for metrics and the step timeline."""
    start_time: float
    duration: float
    num_seqs: int
    num_prefill_tokens: int
    num_decode_tokens: int
    num_preemptions: int
    forward_time: float   # time inside the model forward (the rest is engine overhead)
    phases: dict[str, float] | None = None   # seconds per phase (pdserve/engine/profiler.py), engine only


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_free_blocks: int
    num_total_blocks: int
    prefix_cache_queries: int = 0   # totals since start, in tokens
    prefix_cache_hits: int = 0
    spec_decode: object = None      # speculative decoding's totals (spec_decode/speculator.py SpecStats), if on
    # KV transfer (prefill/decode roles), totals since start: bytes moved, seconds spent moving them,
    # transfers done and failed; and the leases a prefill worker holds now
    kv_transfer_bytes: int = 0
    kv_transfer_seconds: float = 0.0
    kv_transfers: int = 0
    kv_transfer_failures: int = 0
    kv_leases: int = 0
    # the CPU forward's thread count now (0: not the engine's to choose) and its changes since start
    cpu_threads: int = 0
    cpu_thread_changes: int = 0

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks
