"""From prompts to Sequences and from sampled tokens to RequestOutputs: tokenization and
admission checks, incremental detokenization, stop conditions, timings, stream hold-back.

The engine and the baseline backends share it, so every backend refuses, stops and streams
by the same rules."""
import torch

from pdserve.engine.grammar import GrammarCompiler
from pdserve.engine.outputs import ListPrefix, RequestOutput
from pdserve.engine.sequence import Sequence
from pdserve.errors import RequestError
from pdserve.sampling_params import SamplingParams
from pdserve.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, vocab_size: int, max_model_len: int):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.grammars = GrammarCompiler(tokenizer, vocab_size)
        tokenizer.byte_pieces()   # the detokenizers' table (~0.15 s for 150k ids): at start, not in a request

    def new_sequence(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                     arrival_time: float) -> Sequence:
        """Tokenize and check a prompt against the context; raise RequestError naming the field."""
        if isinstance(prompt, str):
            ids = self.tokenizer.encode(prompt) if prompt else []  # "" is empty even with a BOS
        else:
            ids = list(prompt)
            bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.vocab_size]
            if bad:
                raise RequestError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {self.vocab_size})",
                                   param="prompt")
        if not ids:
            raise RequestError("prompt is empty", param="prompt")
        if params.top_k > self.vocab_size:
            raise RequestError(f"top_k must be at most the vocabulary size ({self.vocab_size}), got {params.top_k}",
                               param="top_k")
        n, m, limit = len(ids), params.max_tokens, self.max_model_len
        if n >= limit:
            raise RequestError(f"prompt has {n} tokens; this model's maximum context length is {limit} tokens",
                               param="prompt")
        if n + m > limit:
            raise RequestError(f"prompt ({n} tokens) + max_tokens ({m}) = {n + m} exceeds this model's maximum "
                               f"context length of {limit} tokens", param="max_tokens")
        matcher = None if params.grammar is None else self.grammars.matcher(params.grammar)
        seq = Sequence(request_id, ids, params, arrival_time)
        if matcher is not None and params.grammar_after_token is not None:
            seq.pending_matcher = matcher   # constrains from the token after grammar_after_token
        else:
            seq.matcher = matcher
        seq.output.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
        # what _check_stop looks for, folded: a token that can stop it, the length it stops at
        # (within the context limit: checked above)
        seq.stop_token_ids = frozenset(params.stop_token_ids)
        seq.stop_ids = seq.stop_token_ids.union(() if params.ignore_eos else self.tokenizer.eos_token_ids)
        seq.max_len = n + m
        if params.min_tokens:   # the ids the sampler masks until min_tokens: one tensor, not a list per step
            seq.min_tokens_banned = torch.tensor(sorted(t for t in seq.stop_ids if t < self.vocab_size),
                                                 dtype=torch.long)
        return seq

    def append_token(self, seq: Sequence, token: int, logprobs: dict | None, now: float) -> None:
        """Add a sampled token; sets seq.finish_reason when a stop condition is met."""
        seq.token_ids.append(token)
        if seq.pending_matcher is not None and token == seq.params.grammar_after_token:
            seq.matcher, seq.pending_matcher = seq.pending_matcher, None   # the grammar starts with the next token
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = now
        m.token_times.append(now)
        if seq.logprobs is not None:
            seq.logprobs.append(logprobs)
        if seq.prompt_logprobs is not None and len(seq.token_ids) == seq.num_prompt_tokens + 1:
            self._decode_prompt_logprobs(seq)   # complete now: the prefill has passed every position
        added = 0   # characters this token added to the text (a long token or held-back bytes: many)
        if not seq.output.deferred:
            piece = seq.output.detokenizer.add(token)
            seq.output.text += piece
            seq.output.num_tokens += 1
            added = len(piece)
        # Most tokens stop nothing: only a stop token id, the length limit or a stop string can
        # (sequences not made by new_sequence have no stop_ids: always checked in full).
        stop_ids = seq.stop_ids
        if (stop_ids is None or token in stop_ids or len(seq.token_ids) >= seq.max_len or seq.params.stop
                or seq.matcher is not None):
            self._check_stop(seq, token, added)
            if seq.finish_reason is not None:
                m.finished_time = now

    def _decode_prompt_logprobs(self, seq: Sequence) -> None:
        """Each prompt logprob entry's decoded_token: the token's own text, as the API's logprobs show it."""
        texts: dict[int, str] = {}
        for entry in seq.prompt_logprobs[1:]:
            for tid, lp in entry.items():
                if tid not in texts:
                    texts[tid] = self.tokenizer.decode([tid], skip_special_tokens=False)
                lp.decoded_token = texts[tid]

    def _check_stop(self, seq: Sequence, token: int, added: int) -> None:
        p = seq.params
        reason = stop = None
        num_tokens = len(seq.token_ids)
        num_output = num_tokens - seq.num_prompt_tokens
        if num_output >= p.min_tokens:
            if not p.ignore_eos and token in self.tokenizer.eos_token_ids:
                reason = "stop"
            elif token in (seq.stop_token_ids if seq.stop_token_ids is not None else p.stop_token_ids):
                reason, stop = "stop", token
            elif p.stop:
                reason, stop = self._check_stop_strings(seq, added)
        if reason is None and seq.matcher is not None and seq.matcher.is_stopped():
            reason = "stop"   # the grammar is complete and allows nothing more (even with ignore_eos)
        if reason is None and (num_output >= p.max_tokens or num_tokens >= self.max_model_len):
            reason = "length"
        if reason is not None:
            seq.finish_reason, seq.stop_reason = reason, stop
            if not isinstance(stop, str):  # emit bytes held back for an incomplete character
                self.catch_up_text(seq)
                seq.output.text += seq.output.detokenizer.flush()

    @staticmethod
    def catch_up_text(seq: Sequence) -> None:
        """Detokenize the output tokens a deferred sequence (OutputText.deferred) has not yet."""
        start = seq.num_prompt_tokens + seq.output.num_tokens
        if start < len(seq.token_ids):
            add = seq.output.detokenizer.add
            seq.output.text += "".join([add(t) for t in seq.token_ids[start:]])
            seq.output.num_tokens = len(seq.token_ids) - seq.num_prompt_tokens

    @staticmethod
    def _check_stop_strings(seq: Sequence, added: int):
        # A new match ends in the text this token added (one token can add many characters): it
        # starts at most len(stop) - 1 characters before that text.
        longest = max(len(s) for s in seq.params.stop)
        tail_start = max(0, len(seq.output.text) - added - longest + 1)
        hits = [(seq.output.text.find(s, tail_start), s) for s in seq.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return None, None
        i, s = min(hits)
        out = seq.output
        out.text = out.text[:i + len(s)] if seq.params.include_stop_str_in_output else out.text[:i]
        return "stop", s

    @classmethod
    def make_output(cls, seq: Sequence, new_tokens: list[int]) -> RequestOutput:
        if seq.output.deferred:
            cls.catch_up_text(seq)
        # While a stop string could still be forming, hold back its possible prefix from the stream.
        finished = seq.is_finished
        stop = seq.params.stop
        if finished or not stop:
            upto = len(seq.output.text)
        else:
            upto = max(seq.output.sent_len, len(seq.output.text) - max(map(len, stop)) + 1)
        new_text = seq.output.text[seq.output.sent_len:upto]
        seq.output.sent_len = upto
        token_ids = ListPrefix(seq.token_ids, seq.num_prompt_tokens, len(seq.token_ids))
        logprobs = None if seq.logprobs is None else ListPrefix(seq.logprobs, 0, len(seq.logprobs))
        # positional: keywords cost 0.3 us more, per request and step
        out = RequestOutput(seq.request_id, seq.prompt_token_ids, token_ids, seq.output.text, new_tokens, new_text,
                            logprobs, finished, seq.finish_reason, seq.metrics, seq.stop_reason)
        out.prompt_logprobs = seq.prompt_logprobs
        return out
