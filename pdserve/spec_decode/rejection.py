"""Acceptance of drafts against the target's k+1 verification rows.

Row i of a verifying sequence holds the target's distribution for the token after its last token
and the first i drafts. Greedy: drafts are kept while each equals the row's argmax, then the
argmax of the first differing row (or the last row) is added: exactly the tokens plain greedy
decoding makes. Sampled: standard speculative sampling (Leviathan et al. 2023; Chen et al. 2023)
with a deterministic proposer, q one-hot on the draft x: x is kept with probability p(x), else the
token is drawn from normalize(max(p - q, 0)), i.e. p without x; all k kept: one more from the last
row. Each emitted token is then distributed as p, the target's filtered distribution (temperature,
top-k, top-p, min-p: what plain sampling draws from)."""
import logging

import numpy as np
import torch

from pdserve.engine.sampler import Sampler

log = logging.getLogger("pdserve.engine")


def accept_greedy(drafts: list[int], argmax: list[int]) -> list[int]:
    """argmax: len(drafts) + 1 target argmaxes. The accepted drafts and the token after them."""
    out = []
    for d, t in zip(drafts, argmax):
        if d != t:
            break
        out.append(d)
    out.append(argmax[len(out)])
    return out


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator) -> list[int]:
    """probs: (len(drafts) + 1, V) target probabilities. The accepted drafts and one more token."""
    k = len(drafts)
    d = torch.tensor(drafts, dtype=torch.long, device=probs.device)
    u = torch.rand(k, generator=generator, device=probs.device)
    keep = (u < probs[torch.arange(k, device=probs.device), d]).tolist()
    a = keep.index(False) if False in keep else k
    p = probs[a]
    if a < k:   # the residual max(p - q, 0) with q one-hot on the rejected draft
        p = p.clone()
        p[drafts[a]] = 0.0
    # the exponential race, as the sampler draws: argmax of p / Exp(1)
    noise = torch.empty_like(p).exponential_(generator=generator)
    return drafts[:a] + [int((p / noise).argmax())]


def verify(verify_rows: list, logits: torch.Tensor | None, argmax: list[int] | None, sampler: Sampler) -> list:
    """verify_rows: (seq, first flat row, n) of each verifying sequence, in row order; logits (or
    the fused argmax) of exactly those rows, concatenated. Returns (seq, tokens, logprobs) per
    sequence; tokens None if its verification failed (that request alone fails)."""
    results, off = [], 0
    for seq, _, n in verify_rows:
        rows = slice(off, off + n)
        off += n
        try:
            drafts = seq.draft.token_ids[:n - 1]
            if argmax is not None:
                results.append((seq, accept_greedy(drafts, argmax[rows]), None))
                continue
            x = logits[rows]
            if seq.params.greedy:
                tokens = accept_greedy(drafts, np.asarray(x.cpu()).argmax(axis=-1).tolist())
            else:
                probs = Sampler._filtered_probs(x, [seq] * n)
                tokens = rejection_sample(probs, drafts, sampler.generator_for(seq))
            lps = None
            if seq.params.logprobs is not None:   # of the raw distribution, as the sampler reports
                m = len(tokens)
                lps = Sampler._logprobs(torch.log_softmax(x[:m], dim=-1), [seq] * m, tokens, set())
            results.append((seq, tokens, lps))
        except Exception:
            log.exception("verification failed for request %s; only it fails", seq.request_id)
            results.append((seq, None, None))
    return results
