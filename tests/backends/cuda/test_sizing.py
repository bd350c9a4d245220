"""The CUDA backend's arithmetic that needs no GPU: the KV cache's blocks under
--gpu-memory-utilization, the decode graphs' batch sizes and a decode batch padded to one."""
import pytest
import torch

GiB = 1 << 30


def test_kv_blocks_are_what_the_utilization_leaves(cuda):
    blocks = cuda.memory.kv_cache_blocks(total=80 * GiB, free=60 * GiB, weights=16 * GiB, peak_activation=2 * GiB,
                                         utilization=0.5, bytes_per_block=GiB // 8)
    assert blocks == (40 - 16 - 2) * 8
    # another process holding memory: what is free after the activations is the cap
    blocks = cuda.memory.kv_cache_blocks(total=80 * GiB, free=20 * GiB, weights=16 * GiB, peak_activation=2 * GiB,
                                         utilization=0.9, bytes_per_block=GiB // 8)
    assert blocks == (20 - 2) * 8


def test_kv_blocks_refuse_a_budget_without_room(cuda):
    with pytest.raises(ValueError, match="no room for the KV cache"):
        cuda.memory.kv_cache_blocks(total=80 * GiB, free=60 * GiB, weights=30 * GiB, peak_activation=11 * GiB,
                                    utilization=0.5, bytes_per_block=1 << 20)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        cuda.memory.kv_cache_blocks(80 * GiB, 60 * GiB, 0, 0, 1.5, 1 << 20)


def test_capture_sizes_and_buckets(cuda):
    g = cuda.graphs
    assert g.capture_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert g.capture_sizes(3) == [1, 2, 3]
    assert g.capture_sizes(1) == [1]
    assert g.capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = g.capture_sizes(32)
    assert [g.bucket_for(b, sizes) for b in (1, 3, 4, 5, 9, 17, 24, 25, 32)] == [1, 4, 4, 8, 16, 24, 24, 32, 32]
    assert g.bucket_for(33, sizes) is None


def test_decode_batch_padded_to_its_bucket(cuda):
    """Three decodes padded to four: the padding token writes slot -1, its sequence has no query
    (its one tile stores nothing) and an empty block table; the tables have the graph's width."""
    flat = [[11, 12, 13], [5, 9, 2], [21, 38, 10]]
    groups = [([1, 1, 1], [0, 1, 2], [6, 10, 3], [[5, 2], [9, 7, 4], [2]])]
    ints, sizes, width = cuda.metadata.pack_step(flat, groups, block_size=4, block_q=2, pad_to=4, table_width=5)
    (ids, pos, slots), meta = cuda.metadata.step_metadata(torch.tensor(ints), sizes, width, 3, 4, 2)
    assert ids.tolist() == [11, 12, 13, 0] and pos.tolist() == [5, 9, 2, 0] and slots.tolist() == [21, 38, 10, -1]
    assert meta.q_lens.tolist() == [1, 1, 1, 0] and meta.ctx_lens.tolist() == [6, 10, 3, 0]
    assert meta.seq_starts.tolist() == [0, 1, 2, 3]
    assert meta.work_seq.tolist() == [0, 1, 2, 3] and meta.work_q0.tolist() == [0, 0, 0, 0]
    assert meta.block_tables.tolist() == [[5, 2, 0, 0, 0], [9, 7, 4, 0, 0], [2, 0, 0, 0, 0], [0] * 5]


def test_prefill_chunks_split_into_query_tiles(cuda):
    flat = [[1] * 6, list(range(6)), list(range(6))]
    groups = [([1], [0], [4], [[0]]), ([5], [1], [9], [[1, 2, 3]])]
    ints, sizes, width = cuda.metadata.pack_step(flat, groups, block_size=4, block_q=2)
    _, meta = cuda.metadata.step_metadata(torch.tensor(ints), sizes, width, 3, 4, 2)
    assert width == 3
    assert meta.work_seq.tolist() == [0, 1, 1, 1] and meta.work_q0.tolist() == [0, 0, 2, 4]


def test_graph_replay_falls_back_to_eager_outside_the_buckets(cuda):
    """Which steps a captured graph takes (prepare's choice; the capture itself needs a GPU)."""
    graphs = cuda.graphs.DecodeGraphs([1, 2, 4], table_width=2, block_size=4, block_q=1, device="cpu")
    graphs.graphs = {s: (None, None, *graphs._views(s, graphs._pack(s)[1])) for s in graphs.sizes}
    decode = ([[1, 2, 3], [4, 5, 6], [7, 8, 9]], [([1, 1, 1], [0, 1, 2], [5, 6, 7], [[0, 1]] * 3)])
    flat, meta = graphs.prepare(*decode)
    assert meta.graph_batch == 4 and [t.tolist() for t in flat] == decode[0]
    assert graphs.buffer[:12].tolist() == [1, 2, 3, 0, 4, 5, 6, 0, 7, 8, 9, -1]
    assert meta.ctx_lens.tolist() == [5, 6, 7, 0] and meta.block_tables[:3].tolist() == [[0, 1]] * 3
    # a step of one block a sequence writes the tables' first column; the second is never read now
    _, again = graphs.prepare([[1, 2, 3]] * 3, [([1, 1, 1], [0, 1, 2], [2, 3, 4], [[5], [6], [7]])])
    assert again is meta and meta.block_tables[:3].tolist() == [[5, 1], [6, 1], [7, 1]]
    assert meta.ctx_lens.tolist() == [2, 3, 4, 0]
    assert graphs.prepare([[1] * 5] * 3, [([1] * 5, list(range(5)), [2] * 5, [[0]] * 5)]) is None   # > 4
    assert graphs.prepare([[1, 2]] * 3, [([2], [0], [2], [[0]])]) is None                            # a prefill
    assert graphs.prepare([[1]] * 3, [([1], [0], [9], [[0, 1, 2]])]) is None                           # > width
