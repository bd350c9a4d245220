"""Prompt logprobs (SamplingParams.prompt_logprobs): the log-probability of each prompt token given
the tokens before it, its rank, and the top-k alternatives, from the hidden rows that the prefill
computes anyway (the row of position p predicts token p + 1).

A step's prefill chunk is already bounded by --max-num-batched-tokens, but the full-vocabulary
logits of even one chunk can be large (8192 rows x 152k vocab = 5 GB of fp32): they are made
at most LOGITS_BYTES at a time, reduced to what was asked for, and dropped.

Each position is computed once: a sequence's list only grows, in order, and a chunk adds only the
positions past its end. A re-prefill after preemption so adds nothing twice; the scheduler does
not take prefix-cache hits past the positions a sequence still needs (a cached block has K/V but
no logits), so no position is ever skipped."""
import torch

from pdserve.engine.outputs import Logprob
from pdserve.engine.sequence import Sequence

LOGITS_BYTES = 64 << 20   # fp32 logits made at once (times ~2 with their log_softmax)


def rows_needing(sched) -> list[tuple[Sequence, int, int, int]]:
    """(seq, first flat row, first position, count) of the step's rows whose logits give prompt
    logprobs still missing; [] in the usual step (a glance at each sequence)."""
    work, start = [], 0
    for seq, n in zip(sched.seqs, sched.num_tokens):
        done = seq.prompt_logprobs
        if done is not None and len(done) < seq.num_prompt_tokens:
            first = seq.num_computed_tokens
            lo, hi = max(first, len(done) - 1), min(first + n, seq.num_prompt_tokens - 1)
            if lo < hi:
                if lo != len(done) - 1:   # the scheduler's rule (module docstring) keeps this from happening
                    raise RuntimeError(f"request {seq.request_id}: prompt logprobs from position {lo} "
                                       f"but only {len(done)} tokens have theirs")
                work.append((seq, start + lo - first, lo, hi - lo))
        start += n
    return work


def compute(backend, model, hidden: torch.Tensor, work: list[tuple[Sequence, int, int, int]], vocab_size: int) -> None:
    """Append each sequence's entries for the rows of `work` (rows_needing) to seq.prompt_logprobs."""
    rows = [r for _, row, _, count in work for r in range(row, row + count)]
    targets = [t for seq, _, pos, count in work for t in seq.token_ids[pos + 1:pos + 1 + count]]
    owners = [seq for seq, _, _, count in work for _ in range(count)]
    step = max(1, LOGITS_BYTES // (4 * vocab_size))
    for i in range(0, len(rows), step):
        logits = backend.compute_logits(model, hidden[rows[i:i + step]]).float()
        _entries(torch.log_softmax(logits, dim=-1), targets[i:i + step], owners[i:i + step])


def _entries(lp: torch.Tensor, targets: list[int], owners: list[Sequence]) -> None:
    tgt = torch.tensor(targets, device=lp.device)[:, None]
    chosen = lp.gather(1, tgt)
    # rank as vLLM counts it: 1 + how many tokens are strictly more likely
    ranks = ((lp > chosen).sum(dim=-1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    k = max(s.params.prompt_logprobs for s in owners)
    top_vals = top_ids = None
    if k:
        top_vals, top_ids = lp.topk(min(k, lp.shape[-1]), dim=-1)
        top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for j, seq in enumerate(owners):
        entry = {targets[j]: Logprob(chosen[j], ranks[j])}
        for r in range(seq.params.prompt_logprobs if k else 0):
            entry.setdefault(top_ids[j][r], Logprob(top_vals[j][r], r + 1))
        seq.prompt_logprobs.append(entry)
