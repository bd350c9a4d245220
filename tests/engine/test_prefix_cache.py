"""The prefix cache in the BlockManager and Scheduler, on fake sequences: exact numbers, no model,
and a property test of its invariants."""
import collections

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.engine import block_manager as bm_module
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import Sequence, SequenceStatus
from pdserve.sampling_params import SamplingParams


def seq(name: str, tokens: list[int], salt: str | None = None) -> Sequence:
    return Sequence(name, tokens, SamplingParams(max_tokens=100, cache_salt=salt), 0.0)


def run_step(sched: Scheduler, token: int = 7):
    """One fake step, as the engine does it: schedule, mark computed (which caches full blocks),
    'sample' a token for each sequence whose tokens are all in the cache."""
    out = sched.schedule(now=1.0)
    sched.mark_computed(out)
    for s in out.seqs:
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(token)
    return out


def cached_setup(num_blocks=16, block_size=4, budget=64):
    bm = BlockManager(num_blocks, block_size, enable_caching=True)
    return bm, Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=8)


def test_a_shared_prefix_is_computed_once_and_its_blocks_shared():
    bm, s = cached_setup()
    a = seq("a", list(range(10)))
    s.add(a)
    out = run_step(s)
    assert out.num_tokens == [10] and len(bm.cached) == 2        # two full blocks registered
    b = seq("b", list(range(8)) + [100, 101, 102])
    s.add(b)
    out = run_step(s)
    # a decodes; b starts at the 8 cached tokens and prefills its 3 own ones
    assert [x.request_id for x in out.seqs] == ["a", "b"] and out.num_tokens == [1, 3]
    assert b.block_table[:2] == a.block_table[:2] and b.block_table[2] not in a.block_table
    assert [bm.ref_counts[x] for x in a.block_table[:2]] == [2, 2]
    assert b.metrics.num_cached_tokens == 8 and a.metrics.num_cached_tokens == 0
    assert (bm.num_queries, bm.num_hits) == (10 + 11, 8)
    # a finishing does not free the blocks b still reads
    s.finish(a, "stop")
    assert [bm.ref_counts[x] for x in b.block_table[:2]] == [1, 1]
    assert not set(b.block_table) & set(bm.free_blocks)
    s.finish(b, "stop")
    bm.check_all_free()


def test_the_last_prompt_token_is_always_computed_and_hits_are_whole_blocks():
    bm, s = cached_setup()
    a = seq("a", list(range(8)))
    s.add(a)
    run_step(s)
    s.finish(a, "stop")
    same = seq("same", list(range(8)))          # fully cached: the last block is recomputed for its logits
    s.add(same)
    out = run_step(s)
    assert out.num_tokens == [4] and same.metrics.num_cached_tokens == 4
    assert same.num_tokens == 9                 # it sampled: the logits were there
    partial = seq("partial", list(range(6)) + [50, 51])   # 1.5 blocks in common: one block reused
    s.add(partial)
    out = run_step(s)
    assert out.num_tokens[-1] == 4 and partial.metrics.num_cached_tokens == 4


def test_freed_cached_blocks_are_evicted_last_and_least_recently_freed_first():
    bm = BlockManager(num_blocks=6, block_size=2, enable_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.admit(a, 5, bm.find_cached(a))
    assert a.block_table == [0, 1, 2]
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)                      # blocks 0 and 1 are full; block 2 is not
    bm.free(a)
    # the unregistered tail block first, then never-used blocks, then the cached ones, tail first
    assert list(bm.free_blocks) == [2, 3, 4, 5, 1, 0]
    b = seq("b", [9, 9, 9, 9, 9, 9, 9])
    bm.admit(b, 7, bm.find_cached(b))
    assert b.block_table == [2, 3, 4, 5] and len(bm.cached) == 2   # nothing evicted yet
    c = seq("c", [8, 8, 8])
    bm.admit(c, 3, bm.find_cached(c))
    assert c.block_table == [1, 0] and bm.cached == {}            # now both were needed
    # a's prefix is gone: no stale hit on a block that holds other content now
    assert bm.find_cached(seq("a2", [1, 2, 3, 4, 5])) == []


def test_a_hit_on_a_free_cached_block_takes_it_off_the_free_queue():
    bm = BlockManager(num_blocks=4, block_size=2, enable_caching=True)
    a = seq("a", [1, 2, 3])
    bm.admit(a, 3, [])
    a.num_computed_tokens = 3
    bm.cache_full_blocks(a)
    bm.free(a)
    b = seq("b", [1, 2, 7, 7, 7, 7, 7])
    hits = bm.find_cached(b)
    assert hits == [0]
    # it needs 4 blocks, one of them cached and free: exactly all 4 free blocks
    assert bm.can_allocate(b, 7, hits) and not bm.can_allocate(b, 9, hits)
    bm.admit(b, 7, hits)
    assert b.block_table[0] == 0 and bm.num_free_blocks == 0 and bm.ref_counts[0] == 1


def test_a_preempted_sequence_re_prefills_only_what_was_evicted():
    bm, s = cached_setup(num_blocks=6, block_size=4, budget=64)
    a, b = seq("a", list(range(12))), seq("b", list(range(100, 111)))
    s.add(a)
    s.add(b)
    run_step(s)                          # a: 3 blocks (all full, cached), b: 3 blocks (2 full)
    assert bm.num_free_blocks == 0 and len(bm.cached) == 5
    # a needs a 4th block to decode: b is preempted; its two full blocks stay cached while free
    out = run_step(s)
    assert out.preempted == [b] and b.num_computed_tokens == 0
    s.finish(a, "stop")
    out = run_step(s)
    # 12 tokens now (prompt + 1): 8 of them cached, 4 computed again
    assert out.seqs == [b] and out.num_tokens == [4] and out.is_prefill == [True]
    assert b.metrics.num_preemptions == 1 and b.metrics.num_cached_tokens == 0   # as of its first admission
    assert bm.num_hits == 8


def test_the_prefill_cap_counts_only_uncached_tokens():
    bm = BlockManager(num_blocks=32, block_size=4, enable_caching=True)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8, max_prefill_tokens_with_decodes=5)
    a = seq("a", list(range(16)))
    s.add(a)
    run_step(s)                               # alone: the whole prompt, no cap without decodes
    b = seq("b", list(range(16)) + list(range(90, 99)))
    s.add(b)
    out = run_step(s)
    # a decodes, so b's prefill is capped at 5 tokens a step, counted from the end of its hit
    assert out.num_tokens == [1, 5] and b.num_computed_tokens == 21 and b.metrics.num_cached_tokens == 16
    out = run_step(s)
    assert out.num_tokens == [1, 4] and b.num_computed_tokens == 25 and b.metrics.num_prefill_steps == 2
    assert b.num_output_tokens == 1


def test_cache_salt_isolates_requests():
    bm, s = cached_setup()
    a = seq("a", list(range(9)), salt="tenant-1")
    s.add(a)
    run_step(s)
    other, same, none = (seq("x", list(range(9)), salt="tenant-2"), seq("y", list(range(9)), salt="tenant-1"),
                         seq("z", list(range(9))))
    assert bm.find_cached(other) == [] and bm.find_cached(none) == []
    assert bm.find_cached(same) == a.block_table[:2]


def test_caching_off_finds_nothing_and_registers_nothing():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=64, max_num_seqs=8)
    for name in ("a", "b"):
        s.add(seq(name, list(range(9))))
    run_step(s)
    run_step(s)
    assert bm.cached == {} and (bm.num_queries, bm.num_hits) == (0, 0)
    assert all(x.metrics.num_cached_tokens == 0 for x in s.running)


def test_concurrent_identical_prompts_chain_on_the_first_registration():
    bm, s = cached_setup()
    a, b = seq("a", list(range(9))), seq("b", list(range(9)))
    s.add(a)
    s.add(b)
    run_step(s)                              # admitted together: neither could hit the other
    assert a.block_table[:2] != b.block_table[:2] and len(bm.cached) == 2   # b's copies stay unregistered
    first_two = a.block_table[:2]
    s.finish(a, "stop")
    for _ in range(3):                       # b's next full block (its generated tokens) chains on a's
        run_step(s, token=5)
    assert b.token_ids[8:] == [8, 7, 5, 5, 5] and b.num_computed_tokens == 12
    c = seq("c", list(range(9)) + [7, 5, 5, 5, 1])
    assert bm.find_cached(c) == [*first_two, b.block_table[2]]


def test_reset_forgets_free_cached_blocks_only():
    bm, s = cached_setup()
    a, b = seq("a", list(range(9))), seq("b", list(range(50, 59)))
    s.add(a)
    s.add(b)
    run_step(s)
    assert (a.block_table, b.block_table) == ([0, 1, 2], [3, 4, 5])
    s.finish(a, "stop")
    assert bm.reset_prefix_cache() == {"reset_blocks": 2, "cached_blocks_in_use": 2}
    assert bm.find_cached(seq("a2", list(range(9)))) == []
    assert bm.find_cached(seq("b2", list(range(50, 59)))) == b.block_table[:2]   # b still runs on them
    assert list(bm.free_blocks)[:3] == [0, 1, 2]              # a's blocks, handed out first now
    s.finish(b, "stop")
    bm.check_all_free()


def test_a_hash_collision_is_a_miss_not_another_prefixs_blocks(monkeypatch):
    monkeypatch.setattr(bm_module, "hash_block", lambda parent, tokens: 0)   # every block collides
    bm = BlockManager(num_blocks=16, block_size=2, enable_caching=True)
    a = seq("a", [1, 2, 3, 4, 5])
    bm.admit(a, 5, [])
    a.num_computed_tokens = 5
    bm.cache_full_blocks(a)
    assert bm.cached == {0: a.block_table[0]}          # its second block collided: caching stopped
    assert bm.find_cached(seq("b", [6, 7, 8])) == []    # same hash, other tokens
    assert bm.find_cached(seq("c", [1, 2, 9])) == a.block_table[:1]


def test_a_child_of_an_evicted_parent_never_matches_a_new_parent_with_its_hash(monkeypatch):
    """The parent is compared by registration, not by hash: here [10, 11] collides with [1, 2],
    and e's block [7, 8] was registered as the child of a's [1, 2], which has been evicted since."""
    def colliding(parent, tokens):
        return hash((parent, (1, 2) if tokens == (10, 11) else tokens))
    monkeypatch.setattr(bm_module, "hash_block", colliding)
    bm = BlockManager(num_blocks=8, block_size=2, enable_caching=True)
    a, e = seq("a", [1, 2, 3, 4, 5]), seq("e", [1, 2, 7, 8, 9])
    for x in (a, e):                        # admitted in the same step: e's [1, 2] is a copy
        bm.admit(x, 5, bm.find_cached(x))
    for x in (a, e):
        x.num_computed_tokens = 5
        bm.cache_full_blocks(x)
    e_child = e.block_table[1]
    assert bm.block_hash[e_child] is not None and bm.block_hash[e.block_table[0]] is None
    bm.free(a)
    g = seq("g", [0] * 10)                  # pressure: a's cached blocks are evicted
    bm.admit(g, 10, [])
    bm.free(g)
    c = seq("c", [10, 11, 12])
    bm.admit(c, 3, bm.find_cached(c))
    c.num_computed_tokens = 3
    bm.cache_full_blocks(c)                 # [10, 11] now registered under [1, 2]'s hash
    b = seq("b", [10, 11, 7, 8, 0])
    assert bm.find_cached(b) == c.block_table[:1]   # e's [7, 8] was computed after [1, 2], not [10, 11]
    assert e.status == SequenceStatus.WAITING and bm.ref_counts[e_child] == 1


# ---- property test: random arrivals, aborts and preemptions, checked after every step

@st.composite
def cached_workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4]))
    num_blocks = draw(st.integers(2, 32))
    capacity = block_size * num_blocks
    budget = draw(st.integers(1, 48))
    max_seqs = draw(st.integers(1, 6))
    prefill_cap = draw(st.sampled_from([0, 1, 3, 48]))
    # prompts built from a few shared prefixes, so that hits, sharing and eviction all happen
    prefixes = [draw(st.lists(st.integers(0, 3), min_size=0, max_size=16)) for _ in range(3)]
    requests = []
    for _ in range(draw(st.integers(1, 10))):
        prompt = draw(st.sampled_from(prefixes)) + draw(st.lists(st.integers(0, 3), max_size=6))
        prompt = (prompt or [0])[:capacity - 1]
        max_tokens = draw(st.integers(1, max(1, min(8, capacity - len(prompt)))))
        if len(prompt) + max_tokens > capacity:   # the engine refuses these at admission
            continue
        arrival = draw(st.integers(0, 8))
        abort = draw(st.none() | st.none() | st.integers(arrival, arrival + 25))
        salt = draw(st.sampled_from([None, None, "t1"]))
        requests.append((arrival, prompt, max_tokens, abort, salt))
    return block_size, num_blocks, budget, max_seqs, prefill_cap, requests


def check_cache(bm: BlockManager, live: list[Sequence]) -> None:
    refs = collections.Counter(b for s in live for b in s.block_table)
    assert all(bm.ref_counts[b] == refs[b] for b in range(bm.num_blocks)), "refcounts != table references"
    free, used = set(bm.free_blocks), set(refs)
    assert len(free) == len(bm.free_blocks) and not free & used, "a block is both free and in use"
    assert free | used == set(range(bm.num_blocks)), "a block is neither free nor in use"
    for h, b in bm.cached.items():
        assert bm.block_hash[b] == h and bm.block_key[b] is not None
    registered = {b for b in range(bm.num_blocks) if bm.block_hash[b] is not None}
    assert registered == set(bm.cached.values()), "a registered block missing from the hash map"
    for s in live:
        assert s.status == SequenceStatus.RUNNING or not s.block_table, "a waiting sequence holds blocks"
        for i, b in enumerate(s.block_table[:s.prefix.num_cached_blocks]):
            if bm.block_key[b] is not None:   # what it shares holds its own tokens
                assert list(bm.block_key[b][1]) == s.token_ids[i * bm.block_size:(i + 1) * bm.block_size]


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cached_workloads())
def test_cache_invariants_hold_after_every_step(workload):
    block_size, num_blocks, budget, max_seqs, prefill_cap, requests = workload
    bm = BlockManager(num_blocks, block_size, enable_caching=True)
    sched = Scheduler(bm, max_num_batched_tokens=budget, max_num_seqs=max_seqs,
                      max_prefill_tokens_with_decodes=prefill_cap)
    seqs = [Sequence(str(i), p, SamplingParams(max_tokens=m, cache_salt=salt), 0.0)
            for i, (_, p, m, _, salt) in enumerate(requests)]
    # Fake K/V: each slot holds the (salt, prefix) its token was computed from. A sequence must
    # only ever read slots holding its own prefix, whoever wrote them.
    kv: dict[int, tuple] = {}
    bound = 16 + sum(len(p) + m for _, p, m, _, _ in requests) * (len(requests) + 1)
    for step in range(bound):
        for s, (arrival, _, _, abort, _) in zip(seqs, requests):
            if arrival == step:
                sched.add(s)
            if abort == step and arrival <= step and not s.is_finished:
                sched.finish(s, "abort")
        out = sched.schedule(now=float(step))
        assert out.total_tokens <= budget and len(out.seqs) <= max_seqs
        if prefill_cap and out.num_decode_tokens:
            assert out.num_prefill_tokens <= prefill_cap
        for s, n in zip(out.seqs, out.num_tokens):
            assert len(s.block_table) * block_size >= s.num_computed_tokens + n, "scheduled past its blocks"
            for p in range(s.num_computed_tokens, s.num_computed_tokens + n):
                b = s.block_table[p // block_size]
                assert bm.ref_counts[b] == 1 and bm.block_hash[b] is None, "a write into a shared block"
                kv[b * block_size + p % block_size] = (s.params.cache_salt, tuple(s.token_ids[:p + 1]))
        sched.mark_computed(out)
        for s in out.seqs:
            if s.num_computed_tokens == s.num_tokens:
                s.token_ids.append(step % 3)
                if s.num_output_tokens >= s.params.max_tokens:
                    sched.finish(s, "length")
        live = [s for s in seqs if not s.is_finished]
        check_cache(bm, live)
        for s in sched.running:
            for p in range(s.num_computed_tokens):
                slot = s.block_table[p // block_size] * block_size + p % block_size
                assert kv[slot] == (s.params.cache_salt, tuple(s.token_ids[:p + 1])), "read another prefix's K/V"
        if all(s.is_finished for s in seqs):
            break
    assert all(s.is_finished for s in seqs), "starved"
    bm.check_all_free()
    assert bm.num_hits <= bm.num_queries
