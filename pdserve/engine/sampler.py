"""Turns the last-position logits of a batch of sequences into next tokens.

Order (as in vLLM): penalties, min_tokens masking, then greedy argmax, or temperature, top-k,
top-p, min-p and a draw. Draws use the exponential race (argmax of p / Exp(1) noise), so each row
can take its noise from its own generator: a seeded request samples the same tokens whatever else
is in the batch. Logprobs are those of the raw model distribution."""
import logging

import torch

from pdserve.engine.grammar import apply_masks, short
from pdserve.engine.sequence import Sequence

log = logging.getLogger("pdserve.engine")


def _argmax_indices(x: torch.Tensor):
    """Row-wise argmax (the first index of the maximum, a NaN counting as the maximum, as torch's):
    a numpy array on CPU, where numpy's vectorized argmax is ~10x faster than torch's (32 x 152k
    logits: 0.4 ms vs 4 ms), a tensor elsewhere."""
    if x.device.type != "cpu":
        return x.argmax(dim=-1)
    return x.numpy().argmax(axis=-1)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.as_tensor(_argmax_indices(x))


class Sampler:
    def __init__(self, eos_token_ids: list[int], device, seed: int = 0):
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.generator = torch.Generator(device).manual_seed(seed)  # for requests without a seed
        self.grammars = None   # the engine's GrammarCompiler, for constrained rows (Sequence.matcher)

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence], masks: torch.Tensor | None = None
                 ) -> tuple[list[int], list[dict[int, float] | None]]:
        """logits: (len(seqs), V), modified in place (they are this step's scratch), needing no grad:
        callers run in inference mode (a no_grad decorator here costs 1.7 us warm, more between two
        forwards, where this runs on cold caches). masks: the grammar masks of the constrained
        rows, in order, if the caller computed them (GrammarCompiler.fill_masks)."""
        if logits.dtype != torch.float32:
            logits = logits.float()
        if all(s.argmax_only for s in seqs):
            # The common batch (all greedy, nothing to apply, no logprobs) skips the per-sequence loops
            # below; the indices go straight to a list (each torch call between two forwards runs
            # cold: several us).
            return _argmax_indices(logits).tolist(), [None] * len(seqs)
        # A per-request failure (a parameter the code cannot hold, a bug one request's state
        # reaches) fails only that request: its row samples None, which the engine fails alone.
        failed: set[int] = set()
        want_logprobs = [s.params.logprobs is not None for s in seqs]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        constrained = [i for i, s in enumerate(seqs) if s.matcher is not None]
        if constrained:   # first: penalties and sampling then see only what the grammar allows
            self._apply_grammars(logits, seqs, constrained, failed, masks)
        for i, s in enumerate(seqs):   # per row, in place
            try:
                self._apply_penalties(logits, i, s)
                self._mask_min_tokens(logits, i, s)
            except Exception:
                self._failed(s, failed, i)

        tokens = _argmax(logits)
        sample_rows = [i for i, s in enumerate(seqs) if not s.params.greedy and i not in failed]
        if sample_rows:
            self._draw(logits, seqs, sample_rows, tokens, failed)
        token_list = tokens.tolist()
        for i in constrained:   # each grammar advances by its row's token
            try:
                if i not in failed and not seqs[i].matcher.consume_token(token_list[i]):
                    self._failed(seqs[i], failed, i, seqs[i].matcher.get_error())
            except Exception:
                self._failed(seqs[i], failed, i)
        logprobs = self._logprobs(raw_logprobs, seqs, token_list, failed)
        for i in failed:
            token_list[i] = None
        return token_list, logprobs

    def take_forced(self, seq: Sequence, token: int) -> int | None:
        """A row its grammar forces to one token (it skipped the logits): the grammar takes it;
        None (that request fails alone) if it cannot."""
        try:
            if seq.matcher.consume_token(token):
                return token
            why = seq.matcher.get_error()
        except Exception as e:
            why = repr(e)
        log.error("sampling failed for request %s; only it fails: %s", seq.request_id, short(why))
        return None

    def _draw(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], tokens: torch.Tensor,
              failed: set[int]) -> None:
        """Sample `rows` into tokens; logits are left as they are. Each row's noise is drawn once
        (a seeded row's generator must not advance twice), the rest is retried row by row if the
        batch fails."""
        noise = {}
        for i in rows:
            try:
                noise[i] = self._exponential(seqs[i], logits.shape[-1])
            except Exception:
                self._failed(seqs[i], failed, i)
        rows = [i for i in rows if i in noise]
        for part in ([rows] if len(rows) == 1 else [rows, *[[i] for i in rows]]):
            try:
                idx = torch.tensor(part, device=logits.device)
                probs = self._filtered_probs(logits[idx], [seqs[i] for i in part])
                tokens[idx] = _argmax(probs / torch.stack([noise[i] for i in part]))
            except Exception:
                if len(part) == 1:
                    self._failed(seqs[part[0]], failed, part[0])
                continue
            if part is rows:   # the whole batch sampled: no retries
                return

    @staticmethod
    def _failed(seq: Sequence, failed: set[int], i: int, why: str | None = None) -> None:
        if why is None:
            log.exception("sampling failed for request %s; only it fails", seq.request_id)
        else:   # a grammar's message, cut: one line per failed row however big the grammar
            log.error("sampling failed for request %s; only it fails: %s", seq.request_id, short(why))
        failed.add(i)

    def _apply_grammars(self, logits: torch.Tensor, seqs: list[Sequence], rows: list[int], failed: set[int],
                        masks: torch.Tensor | None) -> None:
        """-inf for the tokens each constrained row's grammar does not allow next."""
        try:
            masks = masks if masks is not None else self.grammars.fill_masks([seqs[i].matcher for i in rows])
            apply_masks(logits, rows, masks)
        except Exception:   # an API misuse, not a grammar error (those leave the matcher in error)
            for i in rows:
                self._failed(seqs[i], failed, i)
            return
        for i in rows:   # in error, or over the step's budget
            why = self.grammars.failure(seqs[i].matcher, seqs[i].params.grammar)
            if why is not None:
                self._failed(seqs[i], failed, i, str(why))

    def _exponential(self, seq: Sequence, n: int) -> torch.Tensor:
        return torch.empty(n, device=self.device).exponential_(generator=self.generator_for(seq))

    def generator_for(self, seq: Sequence) -> torch.Generator:
        """The RNG a row draws from: its request's own if it gave a seed, else the engine's."""
        if seq.params.seed is not None and seq.generator is None:
            seq.generator = torch.Generator(self.device).manual_seed(seq.params.seed)
        return seq.generator or self.generator

    @staticmethod
    def _apply_penalties(logits: torch.Tensor, i: int, s: Sequence) -> None:
        V = logits.shape[-1]
        p = s.params
        if p.repetition_penalty != 1.0:
            # HF/CTRL rule over prompt and output: shrink positive logits, grow negative ones
            seen = torch.tensor(sorted(set(s.token_ids)), device=logits.device)
            seen = seen[seen < V]
            vals = logits[i, seen]
            # clamped: an extreme penalty must not make +-inf (then NaN in the softmax)
            big = torch.finfo(logits.dtype).max
            logits[i, seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                          vals * p.repetition_penalty).clamp(-big, big)
        if (p.presence_penalty or p.frequency_penalty) and s.num_output_tokens:
            # OpenAI rule over the output only
            out = torch.tensor(s.output_token_ids, device=logits.device)
            counts = torch.bincount(out[out < V], minlength=V).float()
            logits[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()

    def _mask_min_tokens(self, logits: torch.Tensor, i: int, s: Sequence) -> None:
        if s.num_output_tokens < s.params.min_tokens:
            if s.min_tokens_banned is None:   # built once per sequence: the lists can be long
                banned = set(s.params.stop_token_ids).union(() if s.params.ignore_eos else self.eos_token_ids)
                s.min_tokens_banned = torch.tensor(sorted(t for t in banned if t < logits.shape[-1]),
                                                   dtype=torch.long)
            banned = s.min_tokens_banned
            if banned.device != logits.device:
                banned = s.min_tokens_banned = banned.to(logits.device)
            logits[i, banned] = float("-inf")

    @staticmethod
    def _filtered_probs(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        dev = logits.device
        temp = torch.tensor([s.params.temperature for s in seqs], device=dev)
        big = torch.finfo(logits.dtype).max
        logits = (logits / temp[:, None]).clamp(-big, big)
        V = logits.shape[-1]
        top_k = torch.tensor([min(s.params.top_k or V, V) for s in seqs], device=dev)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=dev)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=dev)
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        rank = torch.arange(V, device=dev)[None, :]
        drop = rank >= top_k[:, None]
        # top-p: drop a token once the mass before it already reaches top_p (the first always stays)
        drop |= (sorted_probs.cumsum(dim=-1) - sorted_probs) >= top_p[:, None]
        drop |= sorted_probs < min_p[:, None] * sorted_probs[:, :1]
        drop[:, 0] = False   # the most likely token always stays, whatever top_p rounds to
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        filtered = torch.empty_like(logits).scatter_(-1, order, sorted_logits)
        return filtered.softmax(dim=-1)

    @staticmethod
    def _logprobs(raw: torch.Tensor | None, seqs: list[Sequence], tokens: list[int], failed: set[int]):
        """Each row's {token: logprob}: its sampled token and its top n (params.logprobs). A row that
        fails fails alone. On a GPU the batch's numbers come back in one transfer each (a few syncs,
        not two per row), row by row only if that fails; on the CPU row by row, each row a view."""
        out: list[dict[int, float] | None] = [None] * len(seqs)
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs is not None and raw is not None and i not in failed]
        if len(rows) > 1 and raw.device.type != "cpu":
            try:
                return Sampler._batch_logprobs(raw, seqs, tokens, rows, out)
            except Exception:
                pass
        for i in rows:
            try:
                n = seqs[i].params.logprobs
                top = [t.tolist() for t in raw[i].topk(n)] if n else ([], [])
                out[i] = _logprob_entry(tokens[i], raw[i, tokens[i]].item(), *top)
            except Exception:
                Sampler._failed(seqs[i], failed, i)
        return out

    @staticmethod
    def _batch_logprobs(raw: torch.Tensor, seqs: list[Sequence], tokens: list[int], rows: list[int], out: list):
        n = [seqs[i].params.logprobs for i in rows]
        sub = raw[torch.tensor(rows, device=raw.device)]
        chosen = sub.gather(1, torch.tensor([[tokens[i]] for i in rows], device=raw.device))[:, 0].tolist()
        vals = ids = [[]] * len(rows)
        if max(n):   # the largest top n any row asks for, each row keeping its own n
            vals, ids = (t.tolist() for t in sub.topk(max(n)))
        for j, i in enumerate(rows):
            out[i] = _logprob_entry(tokens[i], chosen[j], vals[j][:n[j]], ids[j][:n[j]])
        return out


def _logprob_entry(token: int, logprob: float, top_values: list[float], top_ids: list[int]) -> dict[int, float]:
    """The sampled token's logprob first, then the top ones (the sampled token among them once)."""
    entry = {token: logprob}
    for v, t in zip(top_values, top_ids):
        entry.setdefault(t, v)
    return entry
