"""The wire format between a decode worker and a prefill worker's KV listener.

Every message is one frame: a fixed header (magic, version, kind, layer, payload length,
CRC-32C of the payload: hardware-computed, ~10x zlib's CRC-32, which would cost more than the
copy) and the payload. Control frames carry JSON; a LAYER frame carries one layer's K
then V bytes of the requested token positions. A frame with a bad magic, version, kind or
length, or whose payload does not match its checksum, is refused (FrameError): the connection
is then dropped, never half-read."""
import json
import socket
import struct

from crc32c import crc32c

MAGIC = b"PDKV"
VERSION = 2   # 2: connections start with the handshake of auth.py
HEADER = struct.Struct("!4sBBHIQI")   # magic, version, kind, reserved, layer, payload bytes, crc32
PULL, RELEASE, LAYER, DONE, ERROR, SHM_READY, HELLO, AUTH, AUTH_OK = range(1, 10)
KINDS = {PULL: "PULL", RELEASE: "RELEASE", LAYER: "LAYER", DONE: "DONE", ERROR: "ERROR", SHM_READY: "SHM_READY",
         HELLO: "HELLO", AUTH: "AUTH", AUTH_OK: "AUTH_OK"}
MAX_CONTROL_BYTES = 1 << 16
IOV_MAX = 1024   # buffers per sendmsg call (Linux's limit)


class FrameError(Exception):
    """A malformed frame, a checksum mismatch, or a peer that broke off mid-frame."""


def _as_bytes(buf) -> memoryview:
    mv = memoryview(buf)
    return mv if mv.format == "B" and mv.ndim == 1 else mv.cast("B")


def send_frame(sock: socket.socket, kind: int, chunks=(), layer: int = 0) -> int:
    """Send one frame whose payload is the concatenation of `chunks` (buffers: sent as they are,
    without joining them first). Returns the payload bytes."""
    chunks = [_as_bytes(c) for c in chunks]
    crc, size = 0, 0
    for c in chunks:
        crc = crc32c(c, crc)
        size += len(c)
    _send_all(sock, [memoryview(HEADER.pack(MAGIC, VERSION, kind, 0, layer, size, crc)), *chunks])
    return size


def send_json(sock: socket.socket, kind: int, obj: dict) -> None:
    send_frame(sock, kind, [json.dumps(obj).encode()])


def _send_all(sock: socket.socket, bufs: list[memoryview]) -> None:
    if not hasattr(sock, "sendmsg"):   # no scatter-gather I/O here: one buffer at a time
        for b in bufs:
            sock.sendall(b)
        return
    i = 0
    while i < len(bufs):
        sent = sock.sendmsg(bufs[i:i + IOV_MAX])
        while sent and i < len(bufs):   # drop what went out; a partly sent buffer keeps its rest
            n = len(bufs[i])
            if sent >= n:
                sent -= n
                i += 1
            else:
                bufs[i] = bufs[i][sent:]
                sent = 0
        while i < len(bufs) and not len(bufs[i]):
            i += 1


def recv_exact(sock: socket.socket, view: memoryview) -> None:
    got = 0
    while got < len(view):
        n = sock.recv_into(view[got:])
        if n == 0:
            raise FrameError(f"the peer closed the connection after {got} of {len(view)} bytes")
        got += n


def _recv_all_into(sock: socket.socket, bufs: list[memoryview]) -> None:
    """Fill every buffer, in order, from the socket (scatter-gather: no staging copy)."""
    i, total = 0, sum(len(b) for b in bufs)
    got_all = 0
    while i < len(bufs):
        got = sock.recvmsg_into(bufs[i:i + IOV_MAX])[0] if hasattr(sock, "recvmsg_into") else sock.recv_into(bufs[i])
        if got == 0:
            raise FrameError(f"the peer closed the connection after {got_all} of {total} bytes")
        got_all += got
        while got and i < len(bufs):
            n = len(bufs[i])
            if got >= n:
                got -= n
                i += 1
            else:
                bufs[i] = bufs[i][got:]
                got = 0
        while i < len(bufs) and not len(bufs[i]):
            i += 1


def recv_layer(sock: socket.socket, chunks: list, layer: int) -> int:
    """Receive the LAYER frame of `layer` straight into `chunks` (buffers whose lengths add up to
    the payload), checking its checksum after; an ERROR frame instead raises ValueError with the
    peer's reason. Returns the payload bytes."""
    head = bytearray(HEADER.size)
    recv_exact(sock, memoryview(head))
    magic, version, kind, _, idx, size, crc = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not a pdserve KV frame (magic {bytes(magic)!r}, version {version})")
    if kind == ERROR and size <= MAX_CONTROL_BYTES:
        payload = bytearray(size)
        recv_exact(sock, memoryview(payload))
        raise ValueError(f"the prefill worker refused: {payload.decode(errors='replace')}")
    chunks = [_as_bytes(c) for c in chunks]
    want = sum(len(c) for c in chunks)
    if kind != LAYER or idx != layer or size != want:
        raise FrameError(f"{KINDS.get(kind, kind)} frame for layer {idx} of {size} bytes; expected LAYER {layer} "
                         f"of {want}")
    _recv_all_into(sock, list(chunks))
    got = 0
    for c in chunks:
        got = crc32c(c, got)
    if got != crc:
        raise FrameError(f"LAYER frame (layer {layer}) fails its checksum")
    return size


def recv_frame(sock: socket.socket, max_bytes: int = MAX_CONTROL_BYTES, into: bytearray | None = None,
               expect: tuple[int, ...] = ()) -> tuple[int, int, memoryview]:
    """One frame: (kind, layer, payload). `into` (at least max_bytes long) receives the payload
    instead of a new buffer; `expect`, if given, lists the kinds accepted here."""
    head = bytearray(HEADER.size)
    recv_exact(sock, memoryview(head))
    magic, version, kind, _, layer, size, crc = HEADER.unpack(head)
    if magic != MAGIC or version != VERSION:
        raise FrameError(f"not a pdserve KV frame (magic {bytes(magic)!r}, version {version})")
    if kind not in KINDS or (expect and kind not in expect):
        raise FrameError(f"unexpected frame kind {kind} (expected {[KINDS[k] for k in expect] or 'any'})")
    if size > max_bytes:
        raise FrameError(f"{KINDS[kind]} frame of {size} bytes, more than the {max_bytes} expected")
    buf = memoryview(into)[:size] if into is not None else memoryview(bytearray(size))
    recv_exact(sock, buf)
    if crc32c(buf) != crc:
        raise FrameError(f"{KINDS[kind]} frame (layer {layer}) fails its checksum")
    return kind, layer, buf


def recv_json(sock: socket.socket, expect: tuple[int, ...]) -> tuple[int, dict]:
    kind, _, payload = recv_frame(sock, MAX_CONTROL_BYTES, expect=expect)
    try:
        obj = json.loads(bytes(payload))
    except ValueError:
        raise FrameError(f"{KINDS[kind]} frame is not JSON") from None
    if not isinstance(obj, dict):
        raise FrameError(f"{KINDS[kind]} frame is not a JSON object")
    return kind, obj
