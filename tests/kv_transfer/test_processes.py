"""Two `pdserve serve` processes, --role prefill (shm) and --role decode, driven by hand as the
proxy drives them; the prefill worker's shared cache file is gone after it stops."""
import os

import httpx

from tests.kv_transfer.pd import SECRET
from tests.server.conftest import Server

BODY = {"prompt": "The lighthouse keeper opened the door and saw", "max_tokens": 10, "temperature": 0}


def test_a_prefill_and_a_decode_process_answer_as_one_engine(tiny_llama, tmp_path):
    env = {"PDSERVE_KV_TRANSFER_SECRET": SECRET}   # as a user would pass it: not on the command line
    pre = Server(tiny_llama, "--role", "prefill", "--kv-transport", "shm", "--kv-lease-s", "30", log_dir=str(tmp_path),
                 env=env)
    dec = Server(tiny_llama, "--role", "decode", log_dir=str(tmp_path), env=env)
    try:
        info = httpx.get(pre.url + "/v1/kv_transfer").json()
        assert info["role"] == "prefill" and info["transport"] == "shm"
        ref = httpx.post(dec.url + "/v1/completions", json=BODY, timeout=60).json()   # plain: prefilled there
        httpx.post(dec.url + "/reset_prefix_cache", json={}, timeout=30).raise_for_status()   # else its cache has the prompt
        dec_id = httpx.get(dec.url + "/v1/kv_transfer").json()["engine_id"]
        first = httpx.post(pre.url + "/v1/completions", timeout=60, json={
            **BODY, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True, "decode_engine_id": dec_id}}).json()
        kv = first["kv_transfer_params"]
        assert kv["transport"] == "shm" and kv["remote_port"] == info["kv_port"]
        out = httpx.post(dec.url + "/v1/completions", json={**BODY, "kv_transfer_params": kv}, timeout=60).json()
        assert out["choices"][0]["text"] == ref["choices"][0]["text"]
        assert dec.wait_for(lambda m: m["pdserve:kv_transfers_total"] == 1)["pdserve:kv_transfer_failures_total"] == 0
        pre.wait_for(lambda m: m["pdserve:kv_leases"] == 0 and m["pdserve:kv_cache_usage_perc"] == 0)
        files = [f for f in os.listdir("/dev/shm") if f.startswith(f"pdserve-kvcache-{pre.proc.pid}-")]
        assert len(files) == 1
    finally:
        dec.stop()
        assert pre.stop() == 0
    assert not os.path.exists(os.path.join("/dev/shm", files[0]))   # removed as it exited
