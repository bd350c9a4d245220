"""The engine as its users see it: what the HTTP server (its engine thread, handlers and live
view) and the Ray replica call, and nothing of the engine's insides.

EngineClient is what every engine the server drives has: LLMEngine, the baselines
(pdserve/baselines) and the tests' stand-ins. PagedEngine adds what only an engine over a paged KV
cache has (LLMEngine); `paged(engine)` is the one place that asks which an engine is, so the
server's code says "if paged" instead of probing attributes one by one."""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol, runtime_checkable

if TYPE_CHECKING:   # names only: the server imports this without torch
    from pdserve.config import EngineConfig
    from pdserve.engine.grammar import GrammarCompiler
    from pdserve.engine.outputs import EngineStats, RequestOutput, StepStats
    from pdserve.engine.scheduler import SchedulerOutput
    from pdserve.engine.sequence import Sequence
    from pdserve.sampling_params import SamplingParams
    from pdserve.tokenizer import Tokenizer


class EngineClient(Protocol):
    """Called on one thread (the server's engine thread), except where a member says otherwise."""
    name: str                     # what serves: "engine" (LLMEngine) or a baseline's --baseline
    config: EngineConfig          # its settings (generation defaults, max_num_seqs, the step budget)
    tokenizer: Tokenizer
    model_name: str
    max_model_len: int
    last_step: StepStats | None   # the latest step's counters (None before the first)
    seqs: dict[str, Sequence]     # the live requests, in arrival order

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    arrival_time: float | None = None) -> None:
        """Admit a request, or raise RequestError (400) / SLOUnattainable (503) naming why."""

    def abort_request(self, request_id: str) -> None:
        """Free what the request holds; its final output comes from the next step()."""

    def step(self) -> list[RequestOutput]: ...

    def has_unfinished_requests(self) -> bool: ...

    def get_stats(self) -> EngineStats: ...


@runtime_checkable
class PagedEngine(EngineClient, Protocol):
    computes_prompt_logprobs: bool
    last_schedule: SchedulerOutput | None   # the latest step's per-request tokens (the live view)

    @property
    def kv_capacity(self) -> int:
        """The longest sequence (prompt + max_tokens) the whole KV cache holds, in tokens."""

    @property
    def num_kv_blocks(self) -> int:
        """The KV cache's blocks (fixed at start: any thread may read it)."""

    @property
    def num_kv_leases(self) -> int:
        """Blocks kept for decode workers to pull (a prefill worker's; any thread may read it)."""

    def wake(self) -> None:
        """Cut short a step's idle wait (thread-safe: the server calls it when it posts a command)."""

    def close(self) -> None: ...

    def reset_prefix_cache(self) -> dict: ...

    def kv_transfer_info(self) -> dict: ...


def paged(engine: EngineClient) -> PagedEngine | None:
    """The engine as a PagedEngine, or None (a baseline, a test's stand-in)."""
    return engine if isinstance(engine, PagedEngine) else None


def grammars(engine: EngineClient) -> GrammarCompiler | None:
    """The engine's structured-output compiler (thread-safe: handlers check a spec with it before
    admitting): LLMEngine's and the baselines' output processor has one, a test's stand-in none."""
    return getattr(getattr(engine, "processor", None), "grammars", None)
