"""One GGUF file opened with the `gguf` package: its metadata as Python values, its tensors raw.

Everything that can be wrong with a file (not GGUF, truncated, an unknown value type) is a
one-line CheckpointError naming the file."""
import functools
import os

import numpy as np

from pdserve.errors import CheckpointError


class GGUFFile:
    def __init__(self, path: str):
        import gguf
        self.path = path
        try:
            with open(path, "rb") as f:
                magic = f.read(4)
        except OSError as e:
            raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
        if magic != b"GGUF":
            raise CheckpointError(f"{path}: not a GGUF file (it starts with {magic!r}, not b'GGUF')")
        try:
            self.reader = gguf.GGUFReader(path, "r")
        except Exception as e:   # the reader raises ValueError/IndexError/struct errors on a broken file
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CheckpointError(f"{path}: unreadable GGUF file, truncated or corrupt ({reason})") from None
        self.tensors = {t.name: t for t in self.reader.tensors}
        self.architecture = self.get("general.architecture")
        if not isinstance(self.architecture, str):
            raise CheckpointError(f"{path}: no general.architecture in its metadata")

    def get(self, key: str, default=None):
        """A metadata value (str, int, float, bool or a list of them), default if absent."""
        field = self.reader.fields.get(key)
        if field is None:
            return default
        try:
            return field.contents()
        except Exception as e:
            raise CheckpointError(f"{self.path}: metadata {key!r} is unreadable ({e})") from None

    def arch_get(self, key: str, default=None):
        """`<architecture>.<key>`."""
        return self.get(f"{self.architecture}.{key}", default)

    def string_array(self, key: str) -> list[str] | None:
        """A large string array (the vocabulary) without one Python call per item of the reader's API."""
        field = self.reader.fields.get(key)
        if field is None:
            return None
        parts = field.parts
        return [bytes(parts[i]).decode("utf-8", "surrogateescape") for i in field.data]

    def int_array(self, key: str) -> np.ndarray | None:
        return self._number_array(key, np.int64)

    def float_array(self, key: str) -> np.ndarray | None:
        """(tokenizer.ggml.scores: float32 in the file, kept exact as float64)"""
        return self._number_array(key, np.float64)

    def _number_array(self, key: str, dtype) -> np.ndarray | None:
        field = self.reader.fields.get(key)
        if field is None:
            return None
        return np.array([field.parts[i][0] for i in field.data], dtype=dtype)


@functools.lru_cache(maxsize=2)
def _open(path: str, mtime_ns: int, size: int) -> GGUFFile:
    return GGUFFile(path)


def open_gguf(path: str) -> GGUFFile:
    """The file, opened once for the config, the tokenizer and the weights (memory-mapped)."""
    try:
        st = os.stat(path)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read ({e.strerror or e})") from None
    return _open(os.path.realpath(path), st.st_mtime_ns, st.st_size)
