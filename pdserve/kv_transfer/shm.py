"""The shared-memory transport, for two workers on one host.

A prefill worker with --kv-transport shm keeps its whole KV cache in a file under /dev/shm
(memory, not disk). To a PULL it answers where the leased positions lie in it (the file, its
slot count, the slot runs); the decode worker maps the file once, read-only, and copies those
runs straight into its own blocks: one copy in all, and no bytes through the socket. The
lease stays pinned until the decode worker says DONE. No checksum: nothing crosses a wire."""
import atexit
import mmap
import os
import re
import tempfile
import uuid

import torch

from pdserve.errors import ConfigError
from pdserve.kv_transfer.layout import KVLayout

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
PREFIX = "pdserve-kvcache-"


def shared_kv_cache(shape: tuple, dtype: torch.dtype) -> tuple[str, torch.Tensor]:
    """A zeroed tensor backed by a new file in SHM_DIR, readable by this user only (removed at
    exit; a worker killed without exiting leaves it to the next one to start); (path, tensor)."""
    _remove_stale()
    path = os.path.join(SHM_DIR, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
    numel = 1
    for n in shape:
        numel *= n
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)   # this user's only: it holds prompts' KV
    try:
        # allocated now: a /dev/shm too small (a container's 64 MiB) fails here, not with SIGBUS later
        os.posix_fallocate(fd, 0, numel * dtype.itemsize)
    except OSError as e:
        os.close(fd)
        _unlink(path)
        raise ConfigError(f"--kv-transport shm: cannot allocate the {numel * dtype.itemsize / 2**20:.0f} MiB KV cache "
                          f"in {SHM_DIR} ({e.strerror}); make it larger, or lower --num-kv-blocks") from None
    os.close(fd)
    atexit.register(_unlink, path)
    return path, torch.from_file(path, shared=True, size=numel, dtype=dtype).view(shape)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_stale() -> None:
    """Files of prefill workers that died without cleaning up (SIGKILL) would hold memory for good."""
    for name in os.listdir(SHM_DIR):
        m = re.fullmatch(PREFIX + r"(\d+)-[0-9a-f]+", name)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            _unlink(os.path.join(SHM_DIR, name))


class RemoteCaches:
    """The decode worker's read-only maps of prefill workers' cache files, by path."""

    def __init__(self):
        self._maps: dict[str, tuple[mmap.mmap, KVLayout]] = {}

    def layout(self, path: str, num_slots: int, like: KVLayout) -> KVLayout:
        if os.path.dirname(path) != SHM_DIR or not os.path.basename(path).startswith(PREFIX):
            raise ValueError(f"{path!r} is not a pdserve KV cache file")
        size = like.planes * like.num_layers * num_slots * like.row_bytes
        entry = self._maps.get(path)
        if entry is None or entry[1].num_slots != num_slots:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size != size:
                    raise ValueError(f"{path} does not hold a cache of this model's layout ({size} bytes)")
                m = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
            entry = self._maps[path] = (m, KVLayout.of_buffer(memoryview(m), like.planes, like.num_layers, num_slots,
                                                                     like.row_bytes))
        return entry[1]


def copy_runs(src: KVLayout, src_runs, dst: KVLayout, dst_runs, cancelled=None) -> int:
    """Copy every layer's K/V of src_runs (a remote cache) into dst_runs (this one's); the bytes."""
    total = 0
    staging = None if dst.on_cpu else bytearray(dst.layer_bytes(dst_runs))
    for layer in range(dst.num_layers):
        if cancelled is not None and cancelled.is_set():
            raise InterruptedError("the request was aborted")
        chunks = src.read_layer(layer, src_runs)
        targets = dst.write_views(layer, dst_runs) or [memoryview(staging)]
        total += _copy_stream(chunks, targets)
        if staging is not None:
            dst.write_layer(layer, dst_runs, memoryview(staging))
    return total


def _copy_stream(chunks, targets) -> int:
    """Copy the concatenation of `chunks` into the concatenation of `targets` (equal lengths)."""
    i = j = a = b = n = 0
    while i < len(chunks) and j < len(targets):
        k = min(len(chunks[i]) - a, len(targets[j]) - b)
        targets[j][b:b + k] = chunks[i][a:a + k]
        a, b, n = a + k, b + k, n + k
        if a == len(chunks[i]):
            i, a = i + 1, 0
        if b == len(targets[j]):
            j, b = j + 1, 0
    if i < len(chunks) or j < len(targets):
        raise ValueError("the remote runs and this worker's runs hold different numbers of tokens")
    return n
