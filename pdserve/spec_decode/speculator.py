"""Per step: which running decodes propose how many drafts, and the bookkeeping after their
verification (rollback of rejected drafts, acceptance estimates, counters).

Adaptive. Each sequence keeps decayed counts of accepted and rejected drafts; a verification that
accepts a of k drafts is a successes and one failure (none if all were accepted), so alpha =
accepts / (accepts + rejects) estimates the chance that a draft is accepted given its predecessors
were, and k drafts are expected to yield E(k) = alpha + alpha^2 + ... + alpha^k extra tokens.
From the step-time model (pdserve/engine/cost_model.py) the k drafts cost c_tok * k plus their
attention pairs (and, for a draft model, its measured time per draft), while a plain decode token
of this batch costs step time / decodes. A sequence proposes the k with the largest saving
E(k) * that - cost(k), if positive with a margin: at batch 1 on a memory-bound machine drafts are
nearly free and a small alpha suffices; in a large compute-bound batch a draft costs about what it
would save and speculation turns itself off. A sequence not proposing lets its counts decay, so
its estimate drifts back to the prior and it probes again later."""
import time

from pdserve.engine.sequence import Sequence
from pdserve.spec_decode.config import SpeculativeConfig

PRIOR = (1.0, 1.0)   # pseudo-counts (accepted, rejected): alpha starts at 0.5
DECAY = 0.8          # per verification (and per step without one): recent steps count most
MARGIN = 1.25        # the saving must beat the cost by this factor: the model is only a fit


class SpecStats:
    """Totals since start (vLLM's spec_decode counters)."""
    def __init__(self, k: int):
        self.num_drafts = 0            # verifications
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def eligible(seq: Sequence) -> bool:
    """Whether seq may speculate now: a decode whose sampling reads nothing that drafts would
    change between positions (grammar, penalties, a min_tokens mask still on). A grammar waiting
    for its start token counts: a draft past that token would escape it."""
    p = seq.params
    return (seq.num_computed_tokens == len(seq.token_ids) - 1 and seq.matcher is None and seq.pending_matcher is None
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty
            and len(seq.token_ids) - seq.num_prompt_tokens >= p.min_tokens)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer, block_manager, cost_model=None):
        self.config, self.proposer, self.block_manager = config, proposer, block_manager
        self.k = config.num_speculative_tokens
        self.cost_model = cost_model
        self.allocates = config.method == "draft_model"   # it writes draft K/V before the scheduler runs
        self.seconds_per_draft = 0.0   # measured proposal time (a draft model's forwards), per draft
        self.stats = SpecStats(self.k)

    def propose(self, running: list[Sequence]) -> None:
        """Before scheduling: set draft_token_ids of every running sequence (most get [])."""
        decodes, cands, ks = 0, [], []
        for seq in running:
            if seq.draft.token_ids:
                seq.draft.token_ids = []
            if seq.num_computed_tokens != len(seq.token_ids) - 1:
                continue
            decodes += 1
            room = seq.max_len - len(seq.token_ids) - 1   # tokens after the one verification always adds
            if room >= 1 and eligible(seq):
                cands.append(seq)
                ks.append(min(self.k, room))
        if not cands:
            return
        ks = self._num_drafts(cands, ks, decodes)
        if self.allocates:   # blocks for the drafts' K/V now; none free: that sequence does not speculate
            ks = [k if k and self.block_manager.try_allocate(s, len(s.token_ids) + k) else 0
                  for s, k in zip(cands, ks)]
        live = [i for i, k in enumerate(ks) if k]
        for i, s in enumerate(cands):
            if not ks[i]:   # not proposing: its estimate drifts back to the prior
                s.draft.accepts *= DECAY
                s.draft.rejects *= DECAY
        if not live:
            return
        seqs = [cands[i] for i in live]
        t0 = time.perf_counter()
        drafts = self.proposer.propose(seqs, [ks[i] for i in live])
        if self.allocates:
            n = sum(map(len, drafts))
            if n:
                self.seconds_per_draft = 0.8 * self.seconds_per_draft + 0.2 * (time.perf_counter() - t0) / n
        for s, d in zip(seqs, drafts):
            s.draft.token_ids = d

    def _num_drafts(self, seqs: list[Sequence], ks: list[int], decodes: int) -> list[int]:
        """Each candidate's number of drafts: the k <= its cap with the best predicted saving."""
        model = self.cost_model
        if model is None or not model.coef.any():   # no step-time model: propose the cap
            return ks
        c0, c_tok, c_seq, c_attn = (float(v) for v in model.coef)
        ctx = sum(len(s.token_ids) for s in seqs)   # plain decode pairs of the candidates, about
        per_token = model.predict(decodes, decodes, ctx * decodes / len(seqs)) / decodes
        draft_cost = self.seconds_per_draft
        out = []
        for seq, cap in zip(seqs, ks):
            a, r = seq.draft.accepts + PRIOR[0], seq.draft.rejects + PRIOR[1]
            alpha = a / (a + r)
            c = len(seq.token_ids) - 1
            best, best_k, gain, p = 0.0, 0, 0.0, 1.0
            for k in range(1, cap + 1):
                p *= alpha
                gain += p
                pairs = (k + 1) * (c + k + 1) - (c + 1)
                saving = gain * per_token - MARGIN * (c_tok * k + c_attn * pairs + draft_cost * k)
                if saving > best:
                    best, best_k = saving, k
            out.append(best_k)
        return out

    def verified(self, sched, sampled: list) -> None:
        """After the forward, before mark_computed: take back the rejected drafts' slots, trim
        blocks past the new length, update the estimates and counters."""
        results = {id(seq): tokens for seq, tokens, _ in sampled if type(tokens) is list or tokens is None}
        if not results:
            return
        stats = self.stats
        for i, (seq, n) in enumerate(zip(sched.seqs, sched.num_tokens)):
            if n < 2 or not seq.draft.token_ids or id(seq) not in results:
                continue
            k, tokens = n - 1, results[id(seq)]
            if tokens is None:   # its verification failed: it fails and frees its blocks
                seq.draft.token_ids = []
                continue
            a = len(tokens) - 1
            sched.reject(i, k - a)
            computed = seq.num_computed_tokens + n - (k - a)
            seq.draft.computed = min(seq.draft.computed, computed)
            self.block_manager.trim(seq, computed + 1)
            seq.draft.accepts = DECAY * seq.draft.accepts + a
            seq.draft.rejects = DECAY * seq.draft.rejects + (a < k)
            stats.num_drafts += 1
            stats.num_draft_tokens += k
            stats.num_accepted_tokens += a
            for j in range(a):
                stats.accepted_per_pos[j] += 1
            seq.draft.token_ids = []


def make_speculator(config: SpeculativeConfig, engine) -> Speculator:
    """The speculator of a built engine (its runner, block manager and step-time model)."""
    if config.method == "ngram":
        from pdserve.spec_decode.ngram import NgramProposer
        proposer = NgramProposer(config)
    else:
        from pdserve.spec_decode.draft_model import DraftModelProposer
        r = engine.runner
        proposer = DraftModelProposer(config.model, engine.config, engine.model_config, r.num_blocks,
                                      engine.max_model_len, engine.tokenizer.eos_token_ids)
    return Speculator(config, proposer, engine.block_manager, engine.cost_model)
