"""The shared-memory transport, for two workers on one host: the prefill worker copies the
requested K/V into a file in /dev/shm (memory, not disk), the decode worker maps it and copies
out of it into its own blocks; the control messages still go over the KV listener's socket.
One copy on each side and no socket traffic for the bytes; no checksum (nothing crosses a wire).
The prefill worker deletes the file once the decode worker says it is done, or the connection
ends."""
import mmap
import os
import tempfile
import uuid

from pdserve.kv_transfer.layout import KVLayout

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def export(layout: KVLayout, runs, directory: str = SHM_DIR) -> tuple[str, int]:
    """Write every layer's payload of `runs` to a new file, layer after layer: (path, bytes)."""
    per_layer = layout.layer_bytes(runs)
    size = per_layer * layout.num_layers
    path = os.path.join(directory, f"pdserve-kv-{uuid.uuid4().hex}")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size) as m:
            view = memoryview(m)
            at = 0
            for layer in range(layout.num_layers):
                for chunk in layout.read_layer(layer, runs):
                    view[at:at + len(chunk)] = chunk
                    at += len(chunk)
            view.release()
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path, size


def load(layout: KVLayout, runs, path: str, size: int, cancelled=None) -> int:
    """Copy a file export() wrote into `runs` of this worker's cache; the bytes copied."""
    per_layer = layout.layer_bytes(runs)
    if size != per_layer * layout.num_layers or not os.path.basename(path).startswith("pdserve-kv-"):
        raise ValueError(f"shared-memory segment {path!r} of {size} bytes does not match the "
                         f"{per_layer * layout.num_layers} bytes asked for")
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        view = memoryview(m)
        try:
            for layer in range(layout.num_layers):
                if cancelled is not None and cancelled.is_set():
                    raise InterruptedError("the request was aborted")
                layout.write_layer(layer, runs, view[layer * per_layer:(layer + 1) * per_layer])
        finally:
            view.release()
    return size
