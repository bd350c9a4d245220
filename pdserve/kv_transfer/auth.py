"""Who may use the KV channel: the per-deployment secret every prefill and decode worker holds.

- Each connection to a KV listener starts with an HMAC challenge-response, both ways: the
  listener sends HELLO {nonce}; the decode worker answers AUTH {engine_id, nonce, mac} (an HMAC
  of both nonces and the id it claims); the listener answers AUTH_OK {mac} with its own HMAC of
  the same. The secret never crosses the wire, and a connection only carries PULL/RELEASE for the
  leases made for the engine id it proved.
- The prefill worker signs the kv_transfer_params it returns (where its listener is, the lease,
  the prompt's hash, the decode worker it is for): a decode worker connects only where signed
  params (or its --kv-transfer-peers) say, never where a client's own params would send it.
- prompt_hash: the SHA-256 of a prompt's token ids, bound into the lease, so a lease's K/V is
  never used for another prompt."""
import hashlib
import hmac
import os
import secrets
import socket
import struct

from pdserve.kv_transfer import frames

ENV = "PDSERVE_KV_TRANSFER_SECRET"
HANDSHAKE_TIMEOUT_S = 10.0   # a peer that does not prove itself in this long is dropped
SIGNED = ("remote_engine_id", "remote_host", "remote_port", "remote_request_id", "num_tokens", "prompt_hash",
          "decode_engine_id")


class AuthError(Exception):
    """The peer does not hold this deployment's secret (or broke off the handshake)."""


def new_secret() -> str:
    return secrets.token_hex(32)


def new_lease_id() -> str:
    return secrets.token_urlsafe(24)


def mac(secret: str, *parts) -> str:
    msg = "\n".join(map(str, parts)).encode("utf-8", "surrogatepass")   # (a peer's JSON may hold any)
    return hmac.new(secret.encode(), msg, hashlib.sha256).hexdigest()


def same(a: str, b: str) -> bool:
    """Constant-time equality of two strings, any characters (compare_digest takes ASCII str only)."""
    return hmac.compare_digest(a.encode("utf-8", "surrogatepass"), b.encode("utf-8", "surrogatepass"))


def prompt_hash(token_ids) -> str:
    return hashlib.sha256(struct.pack(f"<{len(token_ids)}q", *token_ids)).hexdigest()


def sign(secret: str, params: dict) -> str:
    return mac(secret, "pdserve-kv-params-v1", *(params.get(k) for k in SIGNED))


def signed(secret: str, params: dict) -> bool:
    sig = params.get("signature")
    return isinstance(sig, str) and same(sig, sign(secret, params))


def _mac_str(msg: dict, key: str) -> str:
    value = msg.get(key)
    if not isinstance(value, str) or not value or len(value) > 256:
        raise AuthError(f"the handshake's {key} is missing or malformed")
    return value


def accept(conn: socket.socket, secret: str) -> str:
    """The listener's side: the engine id the peer proved; AuthError if it did not."""
    nonce = secrets.token_hex(16)
    frames.send_json(conn, frames.HELLO, {"nonce": nonce})
    try:
        _, msg = frames.recv_json(conn, expect=(frames.AUTH,))
    except frames.FrameError as e:
        raise AuthError(f"no valid AUTH frame: {e}") from None
    engine_id, theirs, their_mac = _mac_str(msg, "engine_id"), _mac_str(msg, "nonce"), _mac_str(msg, "mac")
    if not same(their_mac, mac(secret, "pdserve-kv-client-v1", nonce, theirs, engine_id)):
        raise AuthError("authentication failed (not this deployment's --kv-transfer-secret)")
    frames.send_json(conn, frames.AUTH_OK, {"mac": mac(secret, "pdserve-kv-server-v1", nonce, theirs, engine_id)})
    return engine_id


def connect(conn: socket.socket, secret: str, engine_id: str) -> None:
    """The decode worker's side: prove engine_id, and check the listener holds the secret too
    (AuthError if not; frames.FrameError / OSError if the connection fails)."""
    _, hello = frames.recv_json(conn, expect=(frames.HELLO,))
    theirs, nonce = _mac_str(hello, "nonce"), secrets.token_hex(16)
    frames.send_json(conn, frames.AUTH, {"engine_id": engine_id, "nonce": nonce,
                                         "mac": mac(secret, "pdserve-kv-client-v1", theirs, nonce, engine_id)})
    kind, msg = frames.recv_json(conn, expect=(frames.AUTH_OK, frames.ERROR))
    if kind == frames.ERROR:
        raise AuthError(f"the KV listener refused: {msg.get('error')}")
    if not same(_mac_str(msg, "mac"), mac(secret, "pdserve-kv-server-v1", theirs, nonce, engine_id)):
        raise AuthError("the KV listener does not hold this deployment's secret")


def secret_from(given: str | None) -> str | None:
    """The secret given, else the environment's (None if neither)."""
    return given or os.environ.get(ENV) or None


def parse_peers(text: str | None) -> set[tuple[str, int]] | None:
    """--kv-transfer-peers HOST:PORT,... as a set (None: not given); ValueError naming a bad one."""
    if text is None:
        return None
    peers = set()
    for item in filter(None, (t.strip() for t in text.split(","))):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--kv-transfer-peers: {item!r} is not HOST:PORT")
        peers.add((host.strip("[]"), int(port)))
    return peers
