"""Who may use the KV channel (issue 38): only workers holding the deployment's secret reach the
listener; a lease is pulled or released only by the decode worker it was made for, for the
prompt it was made for; a decode worker connects only where a prefill worker of its deployment
(or its --kv-transfer-peers) says; the lease's id is random; and a lease is released, not left
for --kv-lease-s, when its decode request ends before its pull."""
import logging
import socket
import threading
import time

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.errors import ConfigError, RequestError
from pdserve.kv_transfer import auth, frames, tcp
from tests.helpers import corpus_prompts
from tests.kv_transfer.pd import ENGINE, SECRET, colocated, decode, greedy, prefill

NEW_TOKENS = 6
LONG_LEASE = {"kv_lease_s": 3600}   # so that an expiry can never be what frees a lease here


def wait_until(predicate, step=None, timeout: float = 120.0) -> None:
    """Poll (stepping `step`, an engine, between polls) until predicate() holds; generous deadline."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        if step is not None:
            step.step()
        time.sleep(0.01)


def closed(s: socket.socket) -> bool:
    try:
        return s.recv(1) == b""
    except ConnectionResetError:   # closed with our frame unread
        return True


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_worker_without_the_secret_refuses_to_start(tiny_llama, monkeypatch, role):
    monkeypatch.delenv(auth.ENV, raising=False)
    with pytest.raises(ConfigError, match="PDSERVE_KV_TRANSFER_SECRET"):
        LLMEngine(tiny_llama, role=role, **ENGINE)
    monkeypatch.setenv(auth.ENV, SECRET)   # the environment's is taken (it is not in `ps`)
    engine = LLMEngine(tiny_llama, role=role, **ENGINE)
    assert engine.config.kv_transfer_secret == SECRET and SECRET not in repr(engine.config)
    engine.close()


def test_the_listener_serves_only_peers_holding_the_secret(pair, caplog):
    pre, dec = pair(LONG_LEASE)
    prompts = corpus_prompts(pre.tokenizer, [40])
    params = prefill(pre, prompts, dec)
    port, me = pre.connector.port, dec.connector.engine_id
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        with pytest.raises(auth.AuthError, match="refused"):   # another secret: ERROR, then closed
            tcp.Peer("127.0.0.1", port, "not the secret", me).connect(5)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:   # no handshake: straight to a PULL
            frames.recv_json(s, expect=(frames.HELLO,))
            frames.send_json(s, frames.PULL, {"request_id": params[0]["remote_request_id"], "start": 0, "end": 39,
                                              "prompt_hash": params[0]["prompt_hash"]})
            assert "AUTH" in frames.recv_json(s, expect=(frames.ERROR,))[1]["error"]
            assert closed(s)
    refusals = [r for r in caplog.records if "refused a connection" in r.getMessage()]
    assert len(refusals) == 2 and all(r.exc_info is None for r in refusals)   # a line each, no traceback
    assert not any(params[0]["remote_request_id"] in r.getMessage() for r in caplog.records)
    assert len(pre.connector.leases) == 1   # untouched
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)
    assert finals["d0"].token_ids == colocated(pre.config.model, prompts, NEW_TOKENS, **ENGINE)[0]
    assert dec.get_stats().kv_transfers == 1


def test_the_decode_worker_checks_the_listener_holds_the_secret_too():
    """A listener that cannot prove the secret (an impostor on the advertised port) gets nothing."""
    listener = socket.create_server(("127.0.0.1", 0))

    def impostor():
        conn, _ = listener.accept()
        with conn:
            frames.send_json(conn, frames.HELLO, {"nonce": "n"})
            frames.recv_json(conn, expect=(frames.AUTH,))
            frames.send_json(conn, frames.AUTH_OK, {"mac": auth.mac("a guess", "x")})
            conn.recv(1)
    thread = threading.Thread(target=impostor, daemon=True)
    thread.start()
    with pytest.raises(auth.AuthError, match="does not hold"):
        tcp.Peer("127.0.0.1", listener.getsockname()[1], SECRET, "d").connect(5)
    thread.join(10)
    listener.close()


def test_a_lease_is_only_for_its_decode_worker_and_its_prompt(pair):
    pre, dec = pair(LONG_LEASE)
    prompts = corpus_prompts(pre.tokenizer, [40, 40])   # two prompts of the same length
    params = prefill(pre, prompts, dec)
    a, b = params
    assert a["remote_request_id"] not in ("p0", "p1") and len(a["remote_request_id"]) >= 32   # random, not the id
    assert a["remote_request_id"] != b["remote_request_id"]

    def ask(kind, body, engine_id):
        with tcp.Peer("127.0.0.1", pre.connector.port, SECRET, engine_id).connect(5) as s:
            frames.send_json(s, kind, body)
            return frames.recv_json(s, expect=(frames.ERROR, frames.DONE))

    pull = {"request_id": a["remote_request_id"], "start": 0, "end": 39, "prompt_hash": a["prompt_hash"]}
    for kind in (frames.PULL, frames.RELEASE):   # another decode worker, though it holds the secret
        assert "another decode worker" in ask(kind, pull, "another-decode-worker")[1]["error"]
    # the prefill request's id (shown by /v1/engine/steps) is not a lease
    assert "no such KV lease" in ask(frames.PULL, {**pull, "request_id": "p0"}, dec.connector.engine_id)[1]["error"]
    # lease a for b's prompt: refused by the listener before a byte of a's K/V leaves
    assert "another prompt" in ask(frames.PULL, {**pull, "prompt_hash": b["prompt_hash"]},
                                   dec.connector.engine_id)[1]["error"]
    assert len(pre.connector.leases) == 2
    finals = decode(dec, prompts, params, NEW_TOKENS, pre)
    assert [finals[f"d{i}"].token_ids for i in range(2)] == colocated(pre.config.model, prompts, NEW_TOKENS, **ENGINE)


def test_another_prompts_lease_does_not_poison_the_decode_workers_cache(pair):
    """The issue's attack: a request for prompt B carrying the kv_transfer_params of a lease for
    prompt A (same token count) is a 400, so A's K/V never lands in B's cached blocks; params
    changed to claim B's hash fail their signature."""
    pre, dec = pair(LONG_LEASE)
    victim, mine = corpus_prompts(pre.tokenizer, [48, 48])
    theirs = prefill(pre, [victim], dec)[0]
    with pytest.raises(RequestError, match="another prompt") as e:
        dec.add_request("x", mine, greedy(NEW_TOKENS, **theirs))
    assert e.value.param == "kv_transfer_params.prompt_hash"
    forged = {**theirs, "prompt_hash": auth.prompt_hash(mine)}
    with pytest.raises(RequestError, match="signature") as e:
        dec.add_request("y", mine, greedy(NEW_TOKENS, **forged))
    assert e.value.param == "kv_transfer_params.signature"
    stats = dec.get_stats()
    assert stats.kv_transfers == stats.kv_transfer_failures == 0 and not dec.has_unfinished_requests()
    # B, asked for plainly afterwards, is computed from its own tokens, not from A's K/V
    dec.add_request("b", mine, greedy(NEW_TOKENS))
    finals = decode(dec, [victim], [theirs], NEW_TOKENS, pre)
    assert finals["b"].token_ids == colocated(pre.config.model, [mine], NEW_TOKENS, **ENGINE)[0]
    assert finals["d0"].token_ids == colocated(pre.config.model, [victim], NEW_TOKENS, **ENGINE)[0]


def test_a_decode_worker_connects_only_where_its_deployment_says(pair):
    pre, dec = pair(LONG_LEASE)
    prompts = corpus_prompts(pre.tokenizer, [30])
    params = prefill(pre, prompts, dec)[0]
    elsewhere = socket.create_server(("127.0.0.1", 0))   # where a client would send the decode worker
    elsewhere.setblocking(False)
    try:
        moved = {**params, "remote_port": elsewhere.getsockname()[1]}
        with pytest.raises(RequestError, match="signature"):
            dec.add_request("x", prompts[0], greedy(NEW_TOKENS, **moved))
        dec.connector.peers = {("127.0.0.1", elsewhere.getsockname()[1])}   # --kv-transfer-peers without it
        with pytest.raises(RequestError, match="--kv-transfer-peers") as e:
            dec.add_request("y", prompts[0], greedy(NEW_TOKENS, **params))
        assert e.value.param == "kv_transfer_params.remote_host"
        with pytest.raises(BlockingIOError):   # nobody connected
            elsewhere.accept()
    finally:
        elsewhere.close()
    assert len(pre.connector.leases) == 1


def test_a_decode_request_aborted_before_its_pull_releases_the_lease(pair):
    pre, dec = pair(LONG_LEASE)
    prompts = corpus_prompts(pre.tokenizer, [50])
    params = prefill(pre, prompts, dec)
    dec.add_request("d0", prompts[0], greedy(NEW_TOKENS, **params[0]))
    assert dec.seqs["d0"].kv_transfer is not None   # waiting: its pull not begun
    dec.abort_request("d0")
    wait_until(lambda: len(pre.connector.leases) == 0, step=pre)   # released, long before --kv-lease-s
    assert dec.get_stats().kv_transfers == 0
    pre.block_manager.check_all_free()


def test_a_handshake_or_params_with_odd_characters_are_refused_not_crashed(pair, caplog):
    """compare_digest raises TypeError on non-ASCII text: every comparison goes through bytes."""
    pre, dec = pair(LONG_LEASE)
    prompts = corpus_prompts(pre.tokenizer, [20])
    params = prefill(pre, prompts, dec)[0]
    with caplog.at_level(logging.WARNING, logger="pdserve.kv_transfer"):
        for engine_id, mac in (("é", "é"), ("\ud800", "\ud800")):
            with socket.create_connection(("127.0.0.1", pre.connector.port), timeout=5) as s:
                frames.recv_json(s, expect=(frames.HELLO,))
                frames.send_json(s, frames.AUTH, {"engine_id": engine_id, "nonce": "n", "mac": mac})
                assert "authentication failed" in frames.recv_json(s, expect=(frames.ERROR,))[1]["error"]
    assert all(r.exc_info is None for r in caplog.records)
    with pytest.raises(RequestError, match="signature"):
        dec.add_request("x", prompts[0], greedy(NEW_TOKENS, **{**params, "signature": "é"}))
    assert len(pre.connector.leases) == 1
