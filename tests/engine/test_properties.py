"""Property tests (hypothesis): the sampler on random logits and parameters, and the scheduler with
its BlockManager on random arrivals, aborts, lengths, budgets and cache sizes, stepped without a model."""
import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.errors import RequestError
from pdserve.engine.sampler import Sampler
from pdserve.sampling_params import SamplingParams

EOS = 1
SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ---- the sampler

finite = st.floats(-30, 30, allow_nan=False)


@st.composite
def sampling_params(draw, vocab: int) -> SamplingParams:
    greedy = draw(st.booleans())
    max_tokens = draw(st.integers(1, 8))
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=0.0 if greedy else draw(st.floats(0.01, 5.0)),
        top_k=draw(st.sampled_from([0, -1]) | st.integers(1, vocab + 2)),
        top_p=draw(st.just(1.0) | st.floats(0.01, 1.0)),
        min_p=draw(st.just(0.0) | st.floats(0.0, 1.0)),
        seed=draw(st.none() | st.integers(0, 2**31)),
        presence_penalty=draw(st.floats(-2, 2)), frequency_penalty=draw(st.floats(-2, 2)),
        repetition_penalty=draw(st.just(1.0) | st.floats(0.1, 3.0)),
        stop_token_ids=draw(st.lists(st.integers(0, vocab - 1), max_size=2)),
        min_tokens=draw(st.integers(0, max_tokens)), ignore_eos=draw(st.booleans()),
        logprobs=draw(st.none() | st.integers(0, min(vocab, 20))))


@st.composite
def sampler_batches(draw):
    """(logits (B, V), per row: params, prompt ids, output ids)."""
    vocab = draw(st.integers(4, 40))
    rows = []
    for _ in range(draw(st.integers(1, 5))):
        params = draw(sampling_params(vocab))
        prompt = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=6))
        output = draw(st.lists(st.integers(0, vocab - 1), max_size=6))
        rows.append((params, prompt, output))
    logits = torch.tensor([draw(st.lists(finite, min_size=vocab, max_size=vocab)) for _ in rows])
    return logits, rows


def make_seqs(rows) -> list[Sequence]:
    seqs = []
    for params, prompt, output in rows:
        s = Sequence("x", prompt, params, 0.0)
        s.token_ids.extend(output)
        seqs.append(s)
    return seqs


def reference_logits(logits: torch.Tensor, params: SamplingParams, prompt, output) -> torch.Tensor:
    """The documented rules, written out again: HF repetition penalty over prompt + output, OpenAI
    presence/frequency over the output, EOS and stop ids masked before min_tokens."""
    x = logits.float().clone()   # in the sampler's precision: a tiny penalty may round away in both
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t in set(output):
        x[t] -= params.frequency_penalty * output.count(t) + params.presence_penalty
    if len(output) < params.min_tokens:
        for t in params.stop_token_ids + ([] if params.ignore_eos else [EOS]):
            x[t] = -math.inf
    return x


def allowed(x: torch.Tensor, params: SamplingParams, tol: float = 1e-4) -> set[int]:
    """Tokens a draw may pick after temperature, top-k, top-p and min-p (ties and rounding tolerated)."""
    if not torch.isfinite(x).any():   # every token masked: nothing to check
        return set(range(len(x)))
    p = torch.softmax(x / params.temperature, dim=-1)
    ok = set()
    for t in range(len(x)):
        if p[t] <= 0 and x[t] != x.max():
            continue
        higher = x > x[t] + 1e-6
        if params.top_k and higher.sum() >= params.top_k:
            continue
        if p[higher].sum() >= params.top_p + tol:
            continue
        if p[t] < params.min_p * p.max() - tol:
            continue
        ok.add(t)
    return ok


@SETTINGS
@given(sampler_batches(), st.integers(0, 1000))
def test_sampler_picks_only_allowed_tokens_and_never_nan(batch, sampler_seed):
    logits, rows = batch
    tokens, logprobs = Sampler([EOS], "cpu", seed=sampler_seed)(logits.clone(), make_seqs(rows))
    V = logits.shape[1]
    for i, ((params, prompt, output), tok, lp) in enumerate(zip(rows, tokens, logprobs)):
        assert 0 <= tok < V
        x = reference_logits(logits[i], params, prompt, output)
        if params.greedy:
            assert x[tok] >= x.max() - 1e-4, "greedy must be the argmax of the penalized logits"
        else:
            assert tok in allowed(x, params), (tok, x, params)
        if params.logprobs is None:
            assert lp is None
        else:
            assert tok in lp and len(lp) <= params.logprobs + 1
            assert all(0 <= t < V and not math.isnan(v) and v <= 1e-6 for t, v in lp.items())
            raw = torch.log_softmax(logits[i].double(), -1)
            assert all(abs(v - raw[t].item()) < 1e-4 for t, v in lp.items()), "logprobs are the raw model's"


@SETTINGS
@given(sampler_batches(), st.integers(0, 1000), st.integers(0, 1000))
def test_seeded_rows_do_not_depend_on_the_batch_or_the_sampler_seed(batch, seed_a, seed_b):
    logits, rows = batch
    # the same seeded rows: once with their batch mates, once alone, each time a fresh sampler and sequences
    together, _ = Sampler([EOS], "cpu", seed=seed_a)(logits.clone(), make_seqs(rows))
    for i, row in enumerate(rows):
        if row[0].seed is not None or row[0].greedy:
            alone, _ = Sampler([EOS], "cpu", seed=seed_b)(logits[i:i + 1].clone(), make_seqs([row]))
            assert alone[0] == together[i]


@settings(max_examples=30, deadline=None)
@given(sampler_batches())
def test_seeded_sequence_is_reproducible_over_steps(batch):
    logits, rows = batch
    rows = [(p, prompt, out) for p, prompt, out in rows if p.seed is not None]
    runs = []
    for _ in range(2):
        sampler, seqs = Sampler([EOS], "cpu", seed=0), make_seqs(rows)
        picks = []
        for _ in range(4):   # the sequence's own generator advances step by step
            tokens, _ = sampler(logits[:len(seqs)].clone(), seqs) if seqs else ([], [])
            picks.append(tokens)
        runs.append(picks)
    assert runs[0] == runs[1]


@settings(max_examples=60, deadline=None)
@given(st.integers(), st.floats(0, 1e-3) | st.floats(1e-3, 1e3))
def test_any_seed_or_temperature_is_refused_or_samples(seed, temperature):
    # A seed torch cannot take once failed the whole engine step (every request in it): it must be
    # refused before admission; a tiny temperature must not turn the draw into NaN.
    try:
        params = SamplingParams(seed=seed, temperature=temperature)
    except RequestError as e:
        assert e.param == "seed"
        return
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.9]])
    tokens, _ = Sampler([EOS], "cpu")(logits.clone(), make_seqs([(params, [0], [])]))
    assert 0 <= tokens[0] < 4
    if temperature < 1e-5:
        assert tokens[0] == 1


# ---- the scheduler and the block manager

@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(1, 40))
    capacity = block_size * num_blocks
    budget = draw(st.integers(1, 64))
    max_seqs = draw(st.integers(1, 8))
    prefill_cap = draw(st.sampled_from([0, 1, 2, 5, 64]))   # max_prefill_tokens_with_decodes
    requests = []
    for _ in range(draw(st.integers(1, 12))):
        prompt = draw(st.integers(1, capacity))
        max_tokens = draw(st.integers(1, max(1, min(20, capacity - prompt))))
        if prompt + max_tokens > capacity:   # the engine refuses these at admission
            prompt = capacity - max_tokens
            if prompt < 1:
                continue
        arrival = draw(st.integers(0, 20))
        abort = draw(st.none() | st.integers(arrival, arrival + 30))
        requests.append((arrival, prompt, max_tokens, abort))
    return block_size, num_blocks, budget, max_seqs, prefill_cap, requests


def check_blocks(bm: BlockManager, live: list[Sequence]) -> None:
    tables = [b for s in live for b in s.block_table]
    assert len(tables) == len(set(tables)), "a block belongs to two sequences"
    assert len(tables) + bm.num_free_blocks == bm.num_blocks, "blocks neither free nor owned"
    for s in live:
        if s.status != SequenceStatus.RUNNING:
            assert s.block_table == [], "a waiting sequence holds blocks"


@settings(max_examples=300, deadline=None)
@given(workloads())
def test_scheduler_never_leaks_never_overbooks_never_starves(workload):
    block_size, num_blocks, budget, max_seqs, prefill_cap, requests = workload
    bm = BlockManager(num_blocks, block_size)
    sched = Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                      max_prefill_tokens_with_decodes=prefill_cap)
    seqs = [Sequence(str(i), list(range(p)), SamplingParams(max_tokens=m), 0.0)
            for i, (_, p, m, _) in enumerate(requests)]
    # a generous bound: every token of every request recomputed once per request, plus arrival time
    bound = 21 + sum(p + m for _, p, m, _ in requests) * (len(requests) + 1)
    finished_at = {}
    for step in range(bound):
        for seq, (arrival, _, _, abort) in zip(seqs, requests):
            if arrival == step:
                sched.add(seq)
            if abort == step and seq.status != SequenceStatus.FINISHED and arrival <= step:
                sched.finish(seq, "abort")
                finished_at[seq.request_id] = step
        out = sched.schedule(now=float(step))
        assert out.total_tokens <= budget and len(out.seqs) <= max_seqs and len(sched.running) <= max_seqs
        assert all(n >= 1 for n in out.num_tokens) and len({id(s) for s in out.seqs}) == len(out.seqs)
        if prefill_cap and out.num_decode_tokens:
            assert out.num_prefill_tokens <= prefill_cap
        for seq, n in zip(out.seqs, out.num_tokens):
            assert seq.status == SequenceStatus.RUNNING
            assert len(seq.block_table) * block_size >= seq.num_computed_tokens + n, "scheduled past its blocks"
            seq.num_computed_tokens += n
        for seq in out.seqs:   # what the engine does with the sampled token
            if seq.num_computed_tokens == seq.num_tokens:
                seq.token_ids.append(7)
                if seq.num_output_tokens >= seq.params.max_tokens:
                    sched.finish(seq, "length")
                    finished_at[seq.request_id] = step
        check_blocks(bm, [s for s in seqs if s.status != SequenceStatus.FINISHED])
        if len(finished_at) == len(seqs):
            break
    assert len(finished_at) == len(seqs), f"starved within {bound} steps: {[s for s in seqs if not s.is_finished]}"
    assert not sched.has_unfinished()
    bm.check_all_free()
    for seq in seqs:
        if seq.finish_reason == "length":
            assert seq.num_output_tokens == seq.params.max_tokens
