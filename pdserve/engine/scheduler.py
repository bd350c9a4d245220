"""Schedules model steps, not requests.

Each step gets a token budget (max_num_batched_tokens) and a sequence cap (max_num_seqs). Running
decodes are served first (one token each), then running prefills continue, then waiting requests
are admitted; any prefill larger than the remaining budget is cut into chunks over several steps.

Decode-aware prefill cap (max_prefill_tokens_with_decodes, 0 = off): in a step that carries at
least one decode, all prefill tokens together (running chunks and admissions) are at most that
many, so a long prompt cannot turn the running streams' next token into a multi-second step; a
step without decodes (an idle server's first prompts) still uses the whole budget. Unlike vLLM's
long_prefill_token_threshold (a per-request chunk limit applied in every step), it bounds the
step's total and only while something decodes. Prefills are served oldest first and the cap is
>= 1, so the oldest prefill advances in every step: nothing starves; later ones may wait a step.
When a running sequence needs a block and none is free, the most recently admitted running
sequence not already scheduled in this step is preempted: its blocks are freed and it goes back to
the front of the queue (behind any remote-prefill request holding its pulled blocks there), to be
re-prefilled (prompt + tokens generated so far) later.

Prefix cache (BlockManager): admission looks the sequence up first; its cached blocks count as
computed (num_computed_tokens starts at the hit), so blocks, budget and the prefill cap are spent
on the uncached rest only. A re-admitted (preempted) sequence so re-prefills only what was evicted.
A request asking for prompt logprobs takes no hit past the first prompt position whose logprobs it
still needs (a cached block holds K/V, not logits): its prompt is computed again.

What depends on the requests' objectives (waiting order, prefill order, a TPOT-driven cap on a
step's prefill tokens, the preemption victim, priority preemption) is the policy's
(pdserve/engine/policy.py); with the default fcfs policy the rules above are the whole story.

Speculative decoding (pdserve/spec_decode): a decode with drafts is scheduled its last token and
its drafts (cut to the budget), with blocks for all; after the forward, SchedulerOutput.reject
takes the rejected drafts' slots back before mark_computed, so they never count as computed and
no block holding them joins the prefix cache.

Remote prefill (a decode worker's KV connector, pdserve/kv_transfer/): a waiting request whose
prompt KV a prefill worker holds is admitted before the others, without budget or seat (in queue
order, while blocks last; not in a step that preempted): it gets blocks for its whole prompt and waits in `loading` (WAITING_FOR_REMOTE_KVS) while the connector pulls the KV
into them in the background. When the pull ends it goes to the front of the queue still holding
its blocks (behind the requests whose pulls ended before), with num_computed_tokens = the tokens
loaded (a failed pull: what was cached here), and is admitted as a prefill of the rest (the last
prompt token at least). Preempted later, it
recomputes like any other sequence.

The scheduler has no model: it can be tested with fake sequences and fake sampled tokens."""
from collections import deque
from dataclasses import dataclass, field

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.policy import FCFSPolicy
from pdserve.engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    seqs: list[Sequence] = field(default_factory=list)       # in flat-batch order: decodes, then prefills
    num_tokens: list[int] = field(default_factory=list)      # tokens scheduled for each of `seqs`
    is_prefill: list[bool] = field(default_factory=list)     # the phase each was in when scheduled
    preempted: list[Sequence] = field(default_factory=list)
    num_prefill_tokens: int = 0   # sums of num_tokens over the prefills and the decodes, kept by add()
    num_decode_tokens: int = 0

    def reject(self, i: int, num_rejected: int) -> None:
        """After the forward: the rejected drafts of the i-th sequence's verification. Their K/V
        slots do not count as computed (mark_computed) and are overwritten by later steps."""
        self.num_tokens[i] -= num_rejected

    @property
    def total_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_tokens

    def add(self, seq: Sequence, n: int, prefill: bool | None = None):
        """prefill: the phase seq is in, when the caller knows it already."""
        if prefill is None:
            prefill = seq.is_prefill
        self.seqs.append(seq)
        self.num_tokens.append(n)
        self.is_prefill.append(prefill)
        if prefill:
            self.num_prefill_tokens += n
        else:
            self.num_decode_tokens += n


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_batched_tokens: int, max_num_seqs: int,
                 max_prefill_tokens_with_decodes: int = 0, policy: FCFSPolicy | None = None, connector=None):
        self.block_manager = block_manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_prefill_tokens_with_decodes = max_prefill_tokens_with_decodes   # 0: no cap
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # in admission order
        self.policy = policy or FCFSPolicy()
        self.now = 0.0   # the time schedule() was called with
        self.connector = connector   # a KVConnectorBase, or None: no remote KV
        self.loading: dict[str, Sequence] = {}   # WAITING_FOR_REMOTE_KVS, by request id

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def schedule(self, now: float) -> SchedulerOutput:
        out = SchedulerOutput()
        self.now = now
        budget = self.max_num_batched_tokens
        room = self.policy.make_room(self, budget)   # priority: evict lower ones for a waiting one
        for victim in room:
            self._preempt(victim)
        prefill_budget = None   # set when the first prefill is reached: decodes are all placed by then
        # Decodes first, so a long prompt never stalls them; then unfinished prefill chunks. (Between
        # two forwards this runs on cold caches, microseconds a sequence: Sequence.is_prefill is
        # inlined, and the block manager is called only when the last block is full.)
        decodes, prefills = [], []
        for seq in self.running:
            (prefills if seq.num_computed_tokens < seq.prefill_len else decodes).append(seq)
        running = SequenceStatus.RUNNING
        block_size = self.block_manager.block_size
        # a policy that ranks prefills by urgency (slo) admits a more urgent waiting request before
        # running prefills continue: a short prompt does not wait for a long one's remaining chunks
        urgent = (self.policy.urgent_waiting(self.waiting) if prefills and self.waiting
                  and len(self.running) < self.max_num_seqs else None)
        for seq in decodes + self.policy.order_prefills(prefills):
            if budget == 0:
                break
            if seq.status is not running:   # preempted earlier in this loop
                continue
            computed = seq.num_computed_tokens
            prefill = computed < seq.prefill_len
            drafts = seq.draft.token_ids   # a speculating decode: its last token and the drafts
            n = min(len(seq.token_ids) - computed + len(drafts), budget)
            if drafts and n <= len(drafts):
                del drafts[max(0, n - 1):]
            if prefill:
                if urgent is not None and self.policy.before(urgent, seq):
                    break
                if prefill_budget is None:
                    prefill_budget = self._prefill_budget(out, budget)
                if prefill_budget == 0:
                    break
                n = min(n, prefill_budget)
            if computed + n > len(seq.block_table) * block_size:   # for a decode, one step in block_size
                while not self.block_manager.try_allocate(seq, computed + n):
                    scheduled = set(map(id, out.seqs))
                    victim = self.policy.victim(self.running, scheduled, seq)
                    self._preempt(victim)
                    out.preempted.append(victim)
                    if victim is seq:
                        break
                if seq.status is not running:
                    continue
            if prefill:   # (a running sequence's first_scheduled_time was set when it was admitted)
                seq.metrics.num_prefill_steps += 1
                prefill_budget -= n
            out.add(seq, n, prefill)
            budget -= n
        # Admit waiting requests (preempted ones are at the front) while budget, seats and blocks last.
        # Not in a step that had to preempt: the cache is full, admitting would only thrash.
        if prefill_budget is None:
            prefill_budget = self._prefill_budget(out, budget)
        self.policy.order_waiting(self.waiting)
        if self.connector is not None and not out.preempted:
            self._park_remote(now)
        while (self.waiting and min(budget, prefill_budget) > 0 and len(self.running) < self.max_num_seqs
               and not out.preempted):
            seq = self.waiting[0]
            if seq.block_table:   # its blocks came with it: its prompt KV was pulled (or the pull failed)
                computed = seq.num_computed_tokens
                n = min(seq.num_tokens - computed, budget, prefill_budget)
                if not self.block_manager.try_allocate(seq, computed + n):
                    break
                self.waiting.popleft()
            else:
                if seq.kv_transfer is not None:   # its KV is remote: it waits for blocks to pull into
                    break
                hits = self.block_manager.find_cached(seq)   # [] with the prefix cache off
                if seq.prompt_logprobs is not None and hits:
                    # cached blocks have no logits: only those before the first position still
                    # needing its prompt logprobs count (vLLM does not use the cache for these at all)
                    hits = hits[:max(0, len(seq.prompt_logprobs) - 1) // block_size]
                computed = len(hits) * block_size
                n = min(seq.num_tokens - computed, budget, prefill_budget)
                if not self.block_manager.can_allocate(seq, computed + n, hits):
                    break
                self.waiting.popleft()
                self.block_manager.admit(seq, computed + n, hits)
            seq.status = SequenceStatus.RUNNING
            seq.prefill_len = seq.num_tokens
            seq.num_computed_tokens = computed
            self.running.append(seq)
            if seq.metrics.first_scheduled_time is None:
                seq.metrics.first_scheduled_time = now
                seq.metrics.num_cached_tokens = computed
            seq.metrics.num_prefill_steps += 1
            out.add(seq, n, True)
            budget -= n
            prefill_budget -= n
        out.preempted.extend(room)
        return out

    def mark_computed(self, out: SchedulerOutput) -> None:
        """After the step's forward: its scheduled tokens are in the cache, and the blocks they
        filled join the prefix cache (not before: a failed step's K/V is never shared)."""
        bm = self.block_manager
        caching, block_size = bm.enable_caching, bm.block_size
        for seq, n in zip(out.seqs, out.num_tokens):
            seq.num_computed_tokens = computed = seq.num_computed_tokens + n
            if caching and computed >= (seq.prefix.num_cached_blocks + 1) * block_size:   # a block filled up
                bm.cache_full_blocks(seq)

    def _prefill_budget(self, out: SchedulerOutput, budget: int) -> int:
        """Prefill tokens this step may still take: the decode-aware cap if any decode is in it."""
        cap = self.max_prefill_tokens_with_decodes
        if cap and any(not p for p in out.is_prefill):
            budget = min(cap, budget)
        return self.policy.prefill_cap(out, budget, self.now)

    def _park_remote(self, now: float) -> None:
        """Give the waiting requests whose prompt KV is remote their blocks and start their pulls,
        in queue order, while blocks last: outside budget and seats, which they need only after."""
        bm = self.block_manager
        for seq in [s for s in self.waiting if s.kv_transfer is not None and not s.block_table]:
            hits = bm.find_cached(seq)
            remote = self.connector.get_num_new_matched_tokens(seq, len(hits) * bm.block_size)
            if not remote:   # nothing to pull after all: an ordinary prefill
                continue
            if not bm.can_allocate(seq, seq.num_prompt_tokens, hits):
                break
            self._park(seq, hits, remote, now)

    def _park(self, seq: Sequence, hits: list[int], remote: int, now: float) -> None:
        """Admit seq to wait for `remote` prompt tokens' KV from a remote worker, holding its blocks."""
        self.waiting.remove(seq)
        self.block_manager.admit(seq, seq.num_prompt_tokens, hits)
        seq.num_computed_tokens = len(hits) * self.block_manager.block_size
        seq.status = SequenceStatus.WAITING_FOR_REMOTE_KVS
        self.loading[seq.request_id] = seq
        if seq.metrics.first_scheduled_time is None:
            seq.metrics.first_scheduled_time = now
            seq.metrics.num_cached_tokens = seq.num_computed_tokens
        self.connector.update_state_after_alloc(seq, remote)

    def resume_loaded(self, seq: Sequence, num_computed_tokens: int) -> None:
        """seq's pull ended with its first num_computed_tokens in its blocks: to the front of the
        queue, behind the pulled requests already there (they are served in the order their pulls
        ended, not the latest first)."""
        del self.loading[seq.request_id]
        seq.num_computed_tokens = num_computed_tokens
        seq.status = SequenceStatus.WAITING
        self.waiting.insert(self._behind_pulled(), seq)

    def _behind_pulled(self) -> int:
        """The queue position after the pulled requests at its front (they hold their blocks)."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].block_table:
            i += 1
        return i

    def _preempt(self, seq: Sequence) -> None:
        """Evict by recompute: free the blocks, requeue at the front; its tokens are kept."""
        self.running.remove(seq)
        self.block_manager.free(seq)
        seq.num_computed_tokens = seq.draft.computed = 0
        seq.draft.token_ids = []
        seq.status = SequenceStatus.WAITING
        seq.metrics.num_preemptions += 1
        # to the front, but behind the pulled requests there (they hold their prompt's blocks and
        # need no more to be admitted): in front of them, one that cannot fit while they hold
        # their blocks would keep them, and itself, waiting for ever
        self.waiting.insert(self._behind_pulled(), seq)

    def finish(self, seq: Sequence, reason: str, free_blocks: bool = True) -> None:
        """Remove a sequence for good (finished or aborted) and free its blocks (free_blocks=False:
        the caller keeps them). A sequence still loading keeps them until its pull has ended
        (the connector's result says when): the pull may be writing into them; one still waiting
        for its pull has the connector release the remote lease."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
            if seq.kv_transfer is not None:   # its pull never started: the remote lease is still held
                self.connector.discard(seq)
        elif seq.status == SequenceStatus.WAITING_FOR_REMOTE_KVS:
            del self.loading[seq.request_id]
            self.connector.cancel(seq)
            free_blocks = False
        if free_blocks:
            self.block_manager.free(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
