"""Speculative decoding: propose k tokens cheaply, verify them in one forward of the target.

A speculating decode is scheduled as a (k+1)-token chunk over its cache (the last token and the
drafts); the runner sends it through the prefill attention path and takes logits at all k+1 rows;
the longest accepted prefix and one more token are kept, the rejected drafts' K/V slots rolled back.

config.py      the options (vLLM's names) and their checks
ngram.py       prompt lookup: what followed the last n tokens earlier in the sequence
draft_model.py a small model of the same tokenizer, its K/V in its own cache on the target's slots
rejection.py   acceptance: exact greedy, and rejection sampling (the output distribution is the target's)
speculator.py  per step: who proposes how many (measured acceptance, the step-time model), and the
               bookkeeping after verification (rollback, counters)"""
