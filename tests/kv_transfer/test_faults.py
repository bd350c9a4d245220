"""Fault paths of a prefill/decode pair: an expired lease, a prefill worker that is gone, a
decode-side abort during a pull, malformed and corrupted frames, mismatched workers."""
import os
import socket
import struct
import threading
import time

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import RequestError
from pdserve.kv_transfer import KVTransferParams, auth, frames, tcp
from pdserve.kv_transfer.layout import KVLayout
from tests.helpers import corpus_prompts
from tests.kv_transfer.pd import ENGINE, SECRET, colocated, decode, drive, greedy, prefill

NEW_TOKENS = 8


def test_expired_lease_frees_blocks_and_decode_recomputes(pair, tiny_llama):
    pre, dec = pair({"kv_lease_s": 0.2})
    prompts = corpus_prompts(pre.tokenizer, [40, 70])
    params = prefill(pre, prompts, dec)
    assert pre.block_manager.num_free_blocks < pre.block_manager.num_blocks   # held by the leases
    time.sleep(0.3)
    pre.step()   # an idle step frees what expired
    assert len(pre.connector.leases) == 0
    pre.block_manager.check_all_free()
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)
    assert [finals[f"d{i}"].token_ids for i in range(2)] == colocated(tiny_llama, prompts, NEW_TOKENS, **ENGINE)
    assert dec.get_stats().kv_transfer_failures == 2 and dec.get_stats().kv_transfers == 0
    dec.block_manager.check_all_free()


def test_fail_policy_fails_the_request_clearly(pair):
    pre, dec = pair({"kv_lease_s": 0.1}, {"kv_load_failure_policy": "fail"})
    prompts = corpus_prompts(pre.tokenizer, [40])
    params = prefill(pre, prompts, dec)
    time.sleep(0.2)
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)
    out = finals["d0"]
    assert out.finish_reason == "error" and out.token_ids == []
    assert "expired" in out.kv_transfer_params["error"]
    dec.block_manager.check_all_free()


def test_prefill_worker_gone_decode_recomputes(pair, tiny_llama):
    pre, dec = pair()
    prompts = corpus_prompts(pre.tokenizer, [50])
    params = prefill(pre, prompts, dec)
    pre.close()   # the listener is gone
    finals = decode(dec, prompts, params, NEW_TOKENS)
    assert finals["d0"].token_ids == colocated(tiny_llama, prompts, NEW_TOKENS, **ENGINE)[0]
    dec.block_manager.check_all_free()


def test_decode_abort_during_pull_frees_blocks_on_both_sides(pair):
    pre, dec = pair()
    layout = pre.connector.server.layout
    read, started, go = layout.read_layer, threading.Event(), threading.Event()

    def slow_read(layer, runs):   # the listener stalls before the second layer
        if layer == 1:
            started.set()
            go.wait(10)
        return read(layer, runs)
    layout.read_layer = slow_read
    prompts = corpus_prompts(pre.tokenizer, [60])
    params = prefill(pre, prompts, dec)
    dec.add_request("d0", prompts[0], greedy(NEW_TOKENS, **params[0]))
    dec.step()   # parks it and starts the pull
    assert dec.scheduler.loading and started.wait(10)
    assert dec.block_manager.num_free_blocks < dec.block_manager.num_blocks
    dec.abort_request("d0")
    finals = drive(dec, pre, timeout=20)
    go.set()
    assert finals["d0"].finish_reason == "abort"
    assert len(pre.connector.leases) == 0
    dec.block_manager.check_all_free()
    pre.block_manager.check_all_free()


def _raw(port: int) -> socket.socket:
    """A connection to the listener, its HELLO read (the handshake not answered)."""
    s = socket.create_connection(("127.0.0.1", port), timeout=5)
    assert frames.recv_json(s, expect=(frames.HELLO,))[1]["nonce"]
    return s


def _authed(port: int, engine_id: str, secret: str = SECRET) -> socket.socket:
    return tcp.Peer("127.0.0.1", port, secret, engine_id).connect(5)


def test_listener_refuses_malformed_frames_and_keeps_serving(pair, tiny_llama):
    pre, dec = pair()
    prompts = corpus_prompts(pre.tokenizer, [30])
    params = prefill(pre, prompts, dec)
    lease, me, prompt_hash = params[0]["remote_request_id"], dec.connector.engine_id, params[0]["prompt_hash"]
    with _raw(pre.connector.port) as s:   # not a frame at all
        s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n" + bytes(32))
        kind, msg = frames.recv_json(s, expect=(frames.ERROR,))   # answered with ERROR, then closed
        assert "not a pdserve KV frame" in msg["error"]
    with _authed(pre.connector.port, me) as s:   # a PULL whose payload fails its checksum
        payload = b'{"request_id": "p0", "start": 0, "end": 29}'
        s.sendall(frames.HEADER.pack(frames.MAGIC, frames.VERSION, frames.PULL, 0, 0, len(payload), 12345) + payload)
        kind, msg = frames.recv_json(s, expect=(frames.ERROR,))
        assert "checksum" in msg["error"]
    with _authed(pre.connector.port, me) as s:   # a pull of positions the lease does not hold
        frames.send_json(s, frames.PULL, {"request_id": lease, "start": 0, "end": 31, "prompt_hash": prompt_hash})
        assert "not within" in frames.recv_json(s, expect=(frames.ERROR,))[1]["error"]
    assert len(pre.connector.leases) == 1
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)   # the lease is intact
    assert finals["d0"].token_ids == colocated(tiny_llama, prompts, NEW_TOKENS, **ENGINE)[0]
    assert dec.get_stats().kv_transfers == 1


def test_pull_refuses_a_corrupted_layer_frame(tiny_llama):
    """A prefill side whose LAYER frame fails its checksum: the pull fails, nothing is trusted."""
    engine = LLMEngine(tiny_llama, **ENGINE)
    layout = KVLayout(engine.runner.kv_cache)
    runs = [(0, 16)]
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]

    def serve():
        conn, _ = listener.accept()
        with conn:
            auth.accept(conn, SECRET)
            frames.recv_json(conn, expect=(frames.PULL,))
            data = bytes(layout.layer_bytes(runs))
            head = frames.HEADER.pack(frames.MAGIC, frames.VERSION, frames.LAYER, 0, 0, len(data), 1)
            conn.sendall(head + data)
            time.sleep(0.5)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    with pytest.raises(tcp.PullError, match="checksum"):
        tcp.pull(tcp.Peer("127.0.0.1", port, SECRET, "d"), "r", "h", 0, 16, layout, runs, "tcp")
    thread.join(5)
    listener.close()


def test_frame_round_trip_and_truncation():
    a, b = socket.socketpair()
    with a, b:
        frames.send_frame(a, frames.LAYER, [b"abc", memoryview(b"defg")], layer=7)
        kind, layer, payload = frames.recv_frame(b, 100)
        assert (kind, layer, bytes(payload)) == (frames.LAYER, 7, b"abcdefg")
        frames.send_frame(a, frames.LAYER, [bytes(200)])
        with pytest.raises(frames.FrameError, match="more than"):
            frames.recv_frame(b, 100)
    a, b = socket.socketpair()
    with b:
        with a:
            a.sendall(struct.pack("!4s", b"PDKV"))
        with pytest.raises(frames.FrameError, match="closed"):
            frames.recv_frame(b)


def test_requests_that_do_not_fit_the_worker_are_refused(pair, tiny_llama):
    pre, dec = pair()
    prompt = corpus_prompts(pre.tokenizer, [20])[0]
    good = dict(do_remote_prefill=True, remote_host="127.0.0.1", remote_port=1, remote_request_id="x", num_tokens=20,
                prompt_hash="h", signature="s")
    with pytest.raises(RequestError, match="block_size") as e:
        dec.add_request("a", prompt, greedy(4, **{**good, "block_size": 32}))
    assert e.value.param == "kv_transfer_params.block_size"
    with pytest.raises(RequestError, match="dtype"):
        dec.add_request("b", prompt, greedy(4, **{**good, "dtype": "bfloat16"}))
    with pytest.raises(RequestError, match="num_tokens"):
        dec.add_request("c", prompt, greedy(4, **{**good, "num_tokens": 21}))
    with pytest.raises(RequestError, match="--role decode"):
        pre.add_request("d", prompt, greedy(4, **good))
    with pytest.raises(RequestError, match="--role prefill"):
        dec.add_request("e", prompt, greedy(4, do_remote_decode=True))
    both = LLMEngine(tiny_llama, **ENGINE)
    with pytest.raises(RequestError, match="--role both"):
        both.add_request("f", prompt, greedy(4, do_remote_decode=True))
    with pytest.raises(RequestError, match="remote_port"):
        KVTransferParams(do_remote_prefill=True, remote_host="h", remote_request_id="x", num_tokens=3, prompt_hash="h",
                         signature="s")
    assert not dec.has_unfinished_requests()


def test_shm_pull_from_a_tcp_prefill_worker_is_refused_and_recomputed(pair, tiny_llama):
    pre, dec = pair()   # its cache is not in shared memory
    prompts = corpus_prompts(pre.tokenizer, [40])
    params = [{**p, "transport": "shm"} for p in prefill(pre, prompts, dec)]
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)
    assert finals["d0"].token_ids == colocated(tiny_llama, prompts, NEW_TOKENS, **ENGINE)[0]
    assert dec.get_stats().kv_transfer_failures == 1 and len(pre.connector.leases) == 0


def test_a_dead_workers_shared_cache_file_is_removed(tmp_path, monkeypatch):
    from pdserve.kv_transfer import shm
    import torch
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    dead = tmp_path / f"{shm.PREFIX}999999999-{'ab' * 16}"   # no such process
    dead.write_bytes(b"x")
    path, cache = shm.shared_kv_cache((2, 1, 4, 1, 2), torch.float32)
    assert not dead.exists() and os.path.exists(path) and cache.abs().sum() == 0
    shm._unlink(path)


def test_a_shared_memory_too_small_for_the_cache_is_a_clear_error(tmp_path, monkeypatch):
    import errno

    import torch
    from pdserve.errors import ConfigError
    from pdserve.kv_transfer import shm

    def full(fd, offset, size):
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(shm, "SHM_DIR", str(tmp_path))
    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ConfigError, match="--num-kv-blocks"):
        shm.shared_kv_cache((2, 1, 4, 1, 2), torch.float32)
    assert not list(tmp_path.iterdir())
