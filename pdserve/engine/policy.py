"""Scheduling policies (--scheduling-policy): the scheduler's decisions that depend on what
requests asked for, as a few hooks the Scheduler calls.

- fcfs: arrival order (preempted sequences first, to resume), the most recently admitted
  running sequence is the preemption victim, no cap on a step's prefill tokens beyond the
  scheduler's own.
- priority: waiting requests by (priority, arrival), lower priority values first (vLLM's
  meaning); when seats or KV blocks bind, a waiting request preempts running ones of strictly
  lower priority (latest arrival first) to get in; a running sequence that needs a block evicts
  the lowest-priority unscheduled one (possibly itself).
- slo: prefills (waiting and running) ordered by TTFT slack, deadline minus the predicted time
  of the prefill still to do (now is common to all, so the order is by that difference); a
  sequence that was preempted after its first token goes first (its TPOT is what suffers). In a
  step that decodes, prefill tokens are capped so the predicted step time stays within what the
  step's decodes can afford, by a StepCostModel. A TPOT target is a mean over the request's
  tokens, so each decode may spend on this step its target (less TPOT_HEADROOM) plus its credit:
  the time it is ahead of its target so far, and what its next TPOT_LOOKAHEAD tokens will save
  at the predicted decode-step time (at most its remaining max_tokens); the tightest decode sets
  the cap. A request that stops early (eos) before those tokens can so end a little over its
  target. A waiting request more urgent than a running prefill is admitted before that prefill's
  next chunk. The cap is >= 1, so the most urgent prefill advances in every step, and a request without a TTFT target is ordered as
  if it had NO_TARGET_TTFT_S: deadlines are finite, so earliest-deadline order starves nothing.
  With admission="reject", a request whose predicted TTFT misses its target is refused at once.
"""
from pdserve.engine.cost_model import StepCostModel
from pdserve.engine.sequence import Sequence

NO_TARGET_TTFT_S = 30.0
# a step is planned to take at most this share of the tightest TPOT target: step times scatter
# around the model's prediction, and a step planned at exactly the target misses half the time
TPOT_HEADROOM = 0.8
# future tokens whose saving a decode may lend to the current step (see the slo policy above)
TPOT_LOOKAHEAD = 16


class FCFSPolicy:
    name = "fcfs"

    def make_room(self, scheduler, budget: int) -> list[Sequence]:
        """Before a step: running sequences the scheduler should preempt so that a waiting one
        can be admitted."""
        return []

    def order_waiting(self, waiting) -> None:
        """Reorder the scheduler's waiting deque in place (admission takes from its front)."""

    def order_prefills(self, prefills: list[Sequence]) -> list[Sequence]:
        return prefills

    def urgent_waiting(self, waiting) -> Sequence | None:
        """A waiting request that may be admitted before running prefills continue (None: none may)."""
        return None

    def before(self, a: Sequence, b: Sequence) -> bool:
        """Is a more urgent than b (for urgent_waiting's request against a running prefill)?"""
        return False

    def prefill_cap(self, out, budget: int, now: float | None = None) -> int:
        """Prefill tokens this step may take beside the decodes already in `out`."""
        return budget

    def victim(self, running: list[Sequence], scheduled: set[int], seq: Sequence) -> Sequence:
        """Whom to preempt when `seq` needs a KV block and none is free (`scheduled`: ids of
        the sequences already in this step, which stay)."""
        return next((s for s in reversed(running) if id(s) not in scheduled), seq)

    def refuse(self, seq: Sequence, scheduler, now: float) -> str | None:
        """Why `seq` should be refused at arrival, or None to queue it."""
        return None


def priority_key(seq: Sequence):
    return seq.priority, seq.metrics.arrival_time, seq.seq_no


class PriorityPolicy(FCFSPolicy):
    name = "priority"

    def order_waiting(self, waiting) -> None:
        if len(waiting) > 1:
            ordered = sorted(waiting, key=priority_key)
            waiting.clear()
            waiting.extend(ordered)

    def victim(self, running, scheduled, seq):
        return max((s for s in running if id(s) not in scheduled or s is seq), key=priority_key)

    def make_room(self, scheduler, budget):
        waiting, running, bm = scheduler.waiting, scheduler.running, scheduler.block_manager
        if not waiting or not running:
            return []
        head = min(waiting, key=priority_key)
        need = min(head.num_tokens - head.num_computed_tokens, budget)
        missing = bm.blocks_needed(head, need) - bm.num_free_blocks
        if len(running) < scheduler.max_num_seqs and missing <= 0:   # neither seats nor blocks bind
            return []
        lower = sorted((s for s in running if s.priority > head.priority), key=priority_key, reverse=True)
        # evict only if it lets head in: enough lower-priority seats and blocks to take
        if not lower or missing > sum(len(s.block_table) for s in lower):
            return []
        victims, seats = [], len(running)
        for s in lower:
            if seats < scheduler.max_num_seqs and missing <= 0:
                break
            missing -= len(s.block_table)
            seats -= 1
            victims.append(s)
        return victims


class SLOPolicy(FCFSPolicy):
    name = "slo"

    def __init__(self, cost_model: StepCostModel, max_num_batched_tokens: int, admission: str = "serve"):
        self.cost_model = cost_model
        self.max_num_batched_tokens = max_num_batched_tokens
        self.admission = admission

    def deadline(self, seq: Sequence) -> float:
        m = seq.metrics
        return m.arrival_time + (m.ttft_target if m.ttft_target is not None else NO_TARGET_TTFT_S)

    def key(self, seq: Sequence):
        if seq.num_tokens > seq.num_prompt_tokens:   # resumed after a preemption: first, oldest first
            return float("-inf"), seq.metrics.arrival_time, seq.seq_no
        remaining = seq.num_tokens - seq.num_computed_tokens
        predicted = self.cost_model.prefill_time(remaining, self.max_num_batched_tokens, 0, 0)
        return self.deadline(seq) - predicted, seq.metrics.arrival_time, seq.seq_no

    def order_waiting(self, waiting) -> None:
        if len(waiting) > 1:
            ordered = sorted(waiting, key=self.key)
            waiting.clear()
            waiting.extend(ordered)

    def order_prefills(self, prefills):
        return sorted(prefills, key=self.key) if len(prefills) > 1 else prefills

    def urgent_waiting(self, waiting):
        return min(waiting, key=self.key)

    def before(self, a, b):
        return self.key(a)[0] < self.key(b)[0]   # by slack alone: a running prefill keeps ties

    def prefill_cap(self, out, budget, now=None):
        decodes, pairs, targeted = 0, 0, []
        for s, prefill in zip(out.seqs, out.is_prefill):
            if prefill:
                continue
            decodes += 1
            pairs += s.num_computed_tokens + 1
            if s.metrics.tpot_target is not None:
                targeted.append(s)
        if not targeted:   # nothing decoding with a TPOT target: no TPOT at stake
            return budget
        decode_step = self.cost_model.predict(decodes, decodes, pairs)
        allowed = min(self.step_allowance(s, now, decode_step) for s in targeted)
        cap = self.cost_model.max_prefill_tokens(allowed, decodes, pairs, budget)
        return min(budget, max(1, cap))

    @staticmethod
    def step_allowance(seq: Sequence, now: float | None, decode_step: float) -> float:
        """Seconds this step may take for seq to stay within its TPOT target on average: its
        per-token allowance, plus the time it is ahead so far and what its next tokens save."""
        m = seq.metrics
        per_token = TPOT_HEADROOM * m.tpot_target
        if now is None or m.first_token_time is None:
            return per_token
        gaps = seq.num_output_tokens - 1   # token intervals so far (the first token has none)
        banked = per_token * gaps - (now - m.first_token_time)
        ahead = min(TPOT_LOOKAHEAD, max(0, seq.params.max_tokens - seq.num_output_tokens - 1))
        return max(per_token, per_token + banked + ahead * (per_token - decode_step))

    def predicted_ttft(self, seq: Sequence, scheduler) -> float:
        """Seconds until seq's first token if it queues behind every prefill that is more urgent,
        at the per-step prefill rate the current decodes allow."""
        key = self.key(seq)
        ahead = seq.num_tokens
        decodes, pairs, target = 0, 0, None
        for s in scheduler.running:
            if s.num_computed_tokens < s.prefill_len:
                if self.key(s) <= key:
                    ahead += s.prefill_len - s.num_computed_tokens
            else:
                decodes += 1
                pairs += s.num_computed_tokens + 1
                t = s.metrics.tpot_target
                target = t if target is None or (t is not None and t < target) else target
        ahead += sum(s.num_tokens - s.num_computed_tokens for s in scheduler.waiting if self.key(s) <= key)
        budget = self.max_num_batched_tokens - decodes
        per_step = budget if target is None else max(1, self.cost_model.max_prefill_tokens(
            TPOT_HEADROOM * target, decodes, pairs, max(1, budget)))
        return self.cost_model.prefill_time(ahead, per_step, decodes, pairs)

    def refuse(self, seq, scheduler, now):
        target = seq.metrics.ttft_target
        if self.admission != "reject" or target is None:
            return None
        waited = now - seq.metrics.arrival_time
        predicted = waited + self.predicted_ttft(seq, scheduler)
        if predicted <= target:
            return None
        return (f"its TTFT target ({1e3 * target:.0f} ms) cannot be met: the prefills ahead of it and its own "
                f"{seq.num_prompt_tokens} prompt tokens are predicted to take {1e3 * predicted:.0f} ms "
                "(--slo-admission reject)")


POLICIES = ("fcfs", "priority", "slo")


def make_policy(name: str, cost_model: StepCostModel | None = None, max_num_batched_tokens: int = 512,
                admission: str = "serve") -> FCFSPolicy:
    if name == "fcfs":
        return FCFSPolicy()
    if name == "priority":
        return PriorityPolicy()
    if name == "slo":
        if cost_model is None:
            raise ValueError("the slo policy needs a step cost model")
        return SLOPolicy(cost_model, max_num_batched_tokens, admission)
    raise ValueError(f"scheduling policy must be one of {', '.join(POLICIES)}, got {name!r}")
