"""The scheduler with a fake connector (no model, no sockets): a remote-prefill request waits
holding its blocks without budget or seat, resumes with the loaded tokens computed, and after a
preemption simply recomputes; an abort while loading keeps its blocks until the load ends."""
from pdserve.engine.block_manager import BlockManager
from pdserve.engine.scheduler import Scheduler
from pdserve.engine.sequence import SequenceStatus
from pdserve.kv_transfer import KVConnectorBase
from tests.engine.test_scheduler import run_step, seq


class FakeConnector(KVConnectorBase):
    """Every request marked `remote` has its whole prompt but the last token on a remote worker."""

    def __init__(self):
        self.noted, self.cancelled = [], []

    def get_num_new_matched_tokens(self, s, num_computed_tokens):
        return s.num_prompt_tokens - 1 - num_computed_tokens if s.kv_transfer else 0

    def update_state_after_alloc(self, s, num_external_tokens):
        self.noted.append((s.request_id, s.num_computed_tokens, num_external_tokens, list(s.block_table)))
        s.kv_transfer = None

    def cancel(self, s):
        self.cancelled.append(s.request_id)


def test_remote_prefill_waits_holding_blocks_then_computes_only_its_last_token():
    bm = BlockManager(num_blocks=8, block_size=4)
    conn = FakeConnector()
    s = Scheduler(bm, max_num_batched_tokens=6, max_num_seqs=1, connector=conn)
    local, remote = seq("local", 5), seq("remote", 10)
    remote.kv_transfer = True
    s.add(local)
    s.add(remote)
    out = run_step(s)   # local takes the seat and 5 of the 6 tokens; remote is parked all the same
    assert out.seqs == [local] and out.num_tokens == [5]
    assert remote.status is SequenceStatus.WAITING_FOR_REMOTE_KVS and s.loading == {"remote": remote}
    assert conn.noted == [("remote", 0, 9, remote.block_table)] and len(remote.block_table) == 3
    assert bm.num_free_blocks == 8 - 2 - 3
    run_step(s)   # while it loads, the others go on
    s.resume_loaded(remote, 9)
    s.finish(local, "stop")
    out = run_step(s)
    assert out.seqs == [remote] and out.num_tokens == [1] and out.is_prefill == [True]
    assert remote.num_tokens == 11 and len(remote.block_table) == 3   # sampled: no new block for the prompt
    # preempted, it recomputes everything like any sequence (the remote KV is not pulled again)
    s._preempt(remote)
    assert remote.block_table == [] and remote.num_computed_tokens == 0
    out = run_step(s)
    assert out.seqs == [remote] and out.num_tokens == [6] and remote.status is SequenceStatus.RUNNING
    assert len(conn.noted) == 1
    s.finish(remote, "stop")
    bm.check_all_free()


def test_abort_while_loading_leaves_the_blocks_to_the_load():
    bm = BlockManager(num_blocks=8, block_size=4)
    conn = FakeConnector()
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=4, connector=conn)
    r = seq("r", 10)
    r.kv_transfer = True
    s.add(r)
    run_step(s)
    s.finish(r, "abort")
    assert conn.cancelled == ["r"] and not s.loading and not s.has_unfinished()
    assert bm.num_free_blocks == 5   # still held: the pull may be writing into them
    bm.free(r)   # what the engine does when the load reports its end
    bm.check_all_free()


def test_a_failed_pull_recomputes_from_what_was_cached_here():
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=16, max_num_seqs=4, connector=FakeConnector())
    r = seq("r", 10)
    r.kv_transfer = True
    s.add(r)
    run_step(s)
    s.resume_loaded(r, 0)
    out = run_step(s)
    assert out.seqs == [r] and out.num_tokens == [10] and len(r.block_table) == 3
    s.finish(r, "stop")
    bm.check_all_free()


def test_a_preempted_sequence_queues_behind_a_pulled_one():
    """A pulled request waits for a seat holding its prompt's blocks; a sequence preempted
    meanwhile cannot fit while it holds them, so it goes behind it, not before (where nothing
    could ever run again: the simulator found this running the engine)."""
    bm = BlockManager(num_blocks=8, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=32, max_num_seqs=1, connector=FakeConnector())
    a, r = seq("a", 16), seq("r", 13)
    r.kv_transfer = True
    s.add(a)
    s.add(r)
    run_step(s)   # a prefills its 4 blocks and samples; r is parked with the other 4: the cache is full
    s.resume_loaded(r, 12)   # pulled: it waits for the seat a holds
    out = run_step(s)   # a's decode needs a fifth block: a is preempted, and r is not admitted in that step
    assert out.preempted == [a] and list(s.waiting) == [r, a]
    out = run_step(s)
    assert out.seqs == [r] and out.num_tokens == [1]   # r computes its last prompt token
    s.finish(r, "stop")
    out = run_step(s)
    assert out.seqs == [a] and out.num_tokens == [17]   # then a recomputes
    s.finish(a, "stop")
    bm.check_all_free()


def test_pulled_requests_take_seats_in_the_order_their_pulls_ended():
    """Two pulls end while the one seat is taken: the first to end is admitted first (the latest
    first would leave an early one waiting behind every later pull: the simulator's p99 TTFT of
    a seat-bound 2P2D run went from 0.95 s to 3.6 s so)."""
    bm = BlockManager(num_blocks=16, block_size=4)
    s = Scheduler(bm, max_num_batched_tokens=32, max_num_seqs=1, connector=FakeConnector())
    a, r1, r2 = seq("a", 4), seq("r1", 9), seq("r2", 9)
    r1.kv_transfer = r2.kv_transfer = True
    for x in (a, r1, r2):
        s.add(x)
    run_step(s)   # a takes the seat; r1 and r2 are parked
    s.resume_loaded(r1, 8)
    s.resume_loaded(r2, 8)
    s.finish(a, "stop")
    assert run_step(s).seqs == [r1]
