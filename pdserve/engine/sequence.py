"""A request's state inside the engine: token ids, counters and a block table.

Prefill, chunked prefill, decode and re-prefill after preemption are one rule for the scheduler:
schedule `num_tokens - num_computed_tokens` tokens, capped by the budget."""
import enum
import itertools

import torch

from pdserve.engine.outputs import RequestMetrics
from pdserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    WAITING_FOR_REMOTE_KVS = "waiting_for_remote_kvs"   # holds its blocks while its prompt KV is pulled
    FINISHED = "finished"


_counter = itertools.count()


class PrefixCacheState:
    """The prefix cache's bookkeeping of one sequence (BlockManager): the chained hashes of its full
    blocks so far, how many leading blocks of its table are registered (or were offered), and the
    registration the next full block chains from (None: caching stopped for it, after a hash collision)."""
    __slots__ = ("hashes", "num_cached_blocks", "parent")

    def __init__(self):
        self.hashes: list[int] = []
        self.num_cached_blocks = 0
        self.parent = None


class DraftState:
    """Speculative decoding's per-sequence state (pdserve/spec_decode): the drafts proposed for the
    coming step (the scheduler may cut them to its budget), the tokens whose draft-model K/V is
    cached, and decayed counts of accepted and rejected drafts (the acceptance estimate)."""
    __slots__ = ("token_ids", "computed", "accepts", "rejects")

    def __init__(self):
        self.token_ids: list[int] = []
        self.computed = 0
        self.accepts = self.rejects = 0.0


class OutputText:
    """The OutputProcessor's text of one sequence: its incremental detokenizer, the text so far, how
    much of it was streamed, and how many output tokens it holds. A final-only request with no stop
    strings (`deferred`) needs its text only in its outputs: its tokens are detokenized when one is
    made, not in every step."""
    __slots__ = ("detokenizer", "text", "sent_len", "num_tokens", "deferred")

    def __init__(self, deferred: bool):
        self.detokenizer = None
        self.text = ""
        self.sent_len = 0
        self.num_tokens = 0
        self.deferred = deferred


class Sequence:
    # slots, not a dict: the engine reads and writes a dozen of these per sequence in every step,
    # on caches the forward has just flushed. Grouped by concern; the feature-owned ones
    # (prefix cache, speculation, output text) are small objects of their own, above.
    __slots__ = (
        # identity and order
        "request_id", "seq_no", "priority", "params", "status", "metrics",
        # tokens and the phase counters the scheduler's one rule reads
        "token_ids", "prompt_token_ids", "num_prompt_tokens", "num_computed_tokens", "prefill_len",
        # KV: the paged cache's blocks, the prefix cache's state, a remote prompt KV to pull
        "block_table", "prefix", "kv_transfer",
        # sampling and stopping (set by OutputProcessor.new_sequence, read by the sampler)
        "argmax_only", "final_only", "generator", "stop_ids", "stop_token_ids", "max_len", "min_tokens_banned",
        "matcher", "pending_matcher", "draft",
        # what the request gets back
        "logprobs", "prompt_logprobs", "output", "finish_reason", "stop_reason")

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, arrival_time: float):
        self.request_id = request_id
        self.seq_no = next(_counter)          # admission order tiebreak
        self.priority = params.objectives.priority if params.objectives is not None else 0   # lower first
        self.params = params
        self.status = SequenceStatus.WAITING
        self.metrics = RequestMetrics(arrival_time=arrival_time)
        self.token_ids = list(prompt_token_ids)   # only ever appended to: outputs copy prefixes lazily
        self.prompt_token_ids = list(prompt_token_ids)   # every output shares this one copy
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0          # tokens whose K/V are in the cache
        self.prefill_len = 0                  # tokens to prefill at the last (re-)admission
        self.block_table: list[int] = []
        self.prefix = PrefixCacheState()
        # decode role: the KVTransferParams of a prompt KV still to pull (None once the pull is noted)
        self.kv_transfer = None
        # greedy with no penalty, min_tokens mask or logprobs: the sampler only takes the argmax
        self.argmax_only = (params.greedy and params.logprobs is None and params.min_tokens == 0
                            and params.grammar is None
                            and params.repetition_penalty == 1.0 and not params.presence_penalty
                            and not params.frequency_penalty)
        self.final_only = params.final_only   # read per step: one attribute, not two
        # per-request RNG: a seeded request samples the same tokens whatever else is in the batch
        self.generator: torch.Generator | None = None
        # set by OutputProcessor.new_sequence: the token ids that can stop it (eos unless ignored,
        # stop_token_ids) and the length it stops at (prompt + max_tokens)
        self.stop_ids: frozenset[int] | None = None
        self.stop_token_ids: frozenset[int] | None = None   # params.stop_token_ids as a set
        self.max_len = 0
        # the ids masked until min_tokens (stop ids within the vocabulary), as a tensor built once;
        # None: the sampler builds it on first use (sequences not made by new_sequence)
        self.min_tokens_banned: torch.Tensor | None = None
        # constrained decoding: the llguidance matcher of params.grammar (set by new_sequence);
        # a constrained sequence is never argmax_only, so its mask is always applied
        self.matcher = None
        # the matcher of a grammar that starts after params.grammar_after_token is generated (the
        # thinking of a reasoning model is not constrained): it becomes `matcher` then
        self.pending_matcher = None
        self.draft = DraftState()
        self.logprobs: list[dict[int, float]] | None = [] if params.logprobs is not None else None  # appended to
        # prompt logprobs so far, one {token_id: Logprob} per prompt token, the first None (it has no
        # context): the runner appends as prefill chunks pass, once per position (a re-prefill after
        # preemption adds nothing); done when there are num_prompt_tokens
        self.prompt_logprobs: list | None = [None] if params.prompt_logprobs is not None else None
        self.output = OutputText(deferred=params.final_only and not params.stop)
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return self.num_tokens - self.num_prompt_tokens

    @property
    def is_prefill(self) -> bool:
        """In the prefill phase: its (re-)admitted tokens are not all in the cache yet."""
        return self.num_computed_tokens < self.prefill_len

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self):
        return (f"Sequence({self.request_id!r}, tokens={self.num_tokens}, computed={self.num_computed_tokens}, "
                f"blocks={self.block_table}, {self.status.value})")
