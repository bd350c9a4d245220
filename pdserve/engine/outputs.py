"""What the engine hands back: per-request outputs with phase timings, and per-step stats."""
from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.perf_counter seconds) of one request's life."""
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per generated token
    num_prefill_steps: int = 0      # steps that carried part of its (re-)prefill
    num_preemptions: int = 0

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

    def as_dict(self) -> dict:
        return {"ttft_s": self.ttft, "tpot_s": self.tpot, "e2e_s": self.e2e, "queue_time_s": self.queue_time,
                "prefill_time_s": self.prefill_time, "decode_time_s": self.decode_time,
                "num_prefill_steps": self.num_prefill_steps, "num_preemptions": self.num_preemptions}


class ListPrefix:
    """items[start:stop] of a list that only ever grows (a sequence's token ids, its logprobs),
    copied when first read rather than when made. The engine makes an output for every request
    in every step, and most are never read whole: copying the list each time made a request's
    outputs cost O(length^2)."""
    __slots__ = ("items", "start", "stop")

    def __init__(self, items: list, start: int, stop: int):
        self.items, self.start, self.stop = items, start, stop


class _CopiedOnRead:
    """A dataclass field that may be set to a ListPrefix: reading it gives (and keeps) the copy."""

    def __set_name__(self, owner, name):
        self.attr = "_" + name

    def __get__(self, obj, owner=None):
        if obj is None:
            raise AttributeError   # tells the dataclass the field has no default
        value = getattr(obj, self.attr)
        if type(value) is ListPrefix:
            value = value.items[value.start:value.stop]
            setattr(obj, self.attr, value)
        return value

    def __set__(self, obj, value):
        setattr(obj, self.attr, value)


@dataclass
class RequestOutput:
    """The state of one request after a step. `new_*` is what this output adds to the request's
    previous one: this step's token, or everything for a final_only request (its only output)."""
    request_id: str
    prompt_token_ids: list[int]      # shared by all outputs of the request: do not mutate
    token_ids: list[int] = _CopiedOnRead()  # all generated so far
    text: str                       # all generated text so far (stop string removed)
    new_token_ids: list[int]
    new_text: str
    logprobs: list[dict[int, float]] | None = _CopiedOnRead()  # per generated token so far:
    # {token_id: logprob}, sampled one included; None unless the request asked for logprobs
    finished: bool
    finish_reason: str | None       # "stop" (EOS, stop string or stop token), "length", "abort", "error"
    metrics: RequestMetrics
    stop_reason: str | int | None = None  # the stop string or stop token id that ended it, if any

    @property
    def new_logprobs(self) -> list[dict[int, float]] | None:
        """Logprobs of this step's new tokens."""
        return None if self.logprobs is None else self.logprobs[len(self.logprobs) - len(self.new_token_ids):]


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

    @property
    def kv_cache_usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_total_blocks
