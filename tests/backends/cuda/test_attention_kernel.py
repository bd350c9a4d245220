"""The Triton paged attention (and KV write) under Triton's interpreter, against the torch path
(layers/attention.py: gather + masked SDPA, or its explicit softmax for soft caps and sinks) on
the same paged cache: mixed prefill chunks and decodes, cached prefixes, GQA, sliding windows,
soft caps, sinks, several block sizes, fp32 and bf16."""
import pytest
import torch

from tests.backends.cuda.reference import CASES, MIXED, run_both


@pytest.fixture(autouse=True)
def small_key_tiles(cuda, monkeypatch):
    """Key tiles of 16: the contexts here span several, and a tile spans several blocks of 4 or 8."""
    monkeypatch.setattr(cuda.kernels, "KEY_TILE", 16)


@pytest.mark.parametrize("name", list(CASES))
def test_mixed_batch_matches_torch(cuda, name):
    ref, out, caches = run_both(cuda, q_lens=MIXED[0], ctx_lens=MIXED[1], **CASES[name])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)   # the same KV written to the same slots


@pytest.mark.parametrize("name", list(CASES))
def test_split_keys_match_torch(cuda, name):
    """Split-KV: 3 programs share each tile's keys (tiles 0, 3, 6... / 1, 4, ... / 2, 5, ...), their
    softmaxes combined after; a split with no key (short contexts) or the sink counted once."""
    ref, out, _ = run_both(cuda, q_lens=MIXED[0], ctx_lens=MIXED[1], kv_splits=3, **CASES[name])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_kv_splits_heuristic(cuda):
    assert cuda.kernels.kv_splits(1, 8, 132) == 16      # batch 1, 8 KV heads: capped
    assert cuda.kernels.kv_splits(4, 8, 132) == 9       # ceil(264 / 32)
    assert cuda.kernels.kv_splits(64, 8, 132) == 1      # enough programs already
    assert cuda.kernels.kv_splits(1, 8, None) == 1      # not a GPU


@pytest.mark.parametrize("name", ["gqa", "sinks-window", "softcap"])
def test_bf16_matches_torch(cuda, name):
    ref, out, caches = run_both(cuda, q_lens=MIXED[0], ctx_lens=MIXED[1], dtype=torch.bfloat16, **CASES[name])
    torch.testing.assert_close(out, ref, atol=1e-2, rtol=1e-2)   # bf16 output: 2^-8 relative
    torch.testing.assert_close(caches[1], caches[0], atol=0, rtol=0)


def test_decodes_only_and_one_long_prefill(cuda):
    for q_lens, ctx_lens in (([1] * 4, [1, 2, 17, 40]), ([37], [50])):
        ref, out, _ = run_both(cuda, H=4, Hkv=2, D=16, block_size=8, q_lens=q_lens, ctx_lens=ctx_lens)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_tile_wider_than_block(cuda, monkeypatch):
    """Key tiles of 32 positions over blocks of 4: each key's own block looked up."""
    monkeypatch.setattr(cuda.kernels, "KEY_TILE", 32)
    ref, out, _ = run_both(cuda, H=2, Hkv=1, D=16, block_size=4, q_lens=[3, 1], ctx_lens=[30, 45])
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-5)


def test_padding_slot_writes_nothing(cuda):
    """A slot of -1 (a captured batch's padding token) leaves the cache as it was."""
    cache = torch.randn(2, 8, 2, 4)
    before = cache.clone()
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 4)
    cuda.kernels.store_kv(k, v, cache[0], cache[1], torch.tensor([5, -1, 0]))
    torch.testing.assert_close(cache[0, 5], k[0])
    torch.testing.assert_close(cache[1, 0], v[2])
    unchanged = [i for i in range(8) if i not in (0, 5)]
    torch.testing.assert_close(cache[:, unchanged], before[:, unchanged])
