"""benchmarks.kv_transfer reports what moved: the bytes of prompt-len - 1 tokens' K/V per request."""
import json

from benchmarks import kv_transfer
from pdserve.config import ModelConfig


def test_cache_only_run_reports_each_transport(tiny_llama, capsys):
    kv_transfer.main([tiny_llama, "--prompt-len", "40", "--requests", "2", "--cache-only"])
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    m = ModelConfig.from_dir(tiny_llama)
    assert [r["transport"] for r in rows] == ["tcp", "shm"]
    for r in rows:
        assert r["bytes_per_request"] == 39 * 2 * m.num_layers * m.num_kv_heads * m.head_dim * 4
        assert r["ms_per_request_median"] > 0
