"""GGUF files in: llama.cpp's single-file format read into pdserve's config, tokenizer and weights.

A model path is a GGUF model when it is a file (`model.gguf`) or a directory holding exactly one
`.gguf` file and no config.json (with a config.json it is an HF checkpoint). reader.py opens the
file with the `gguf` package, config.py builds the HF-style config from its metadata,
tokenizer.py the tokenizer and chat template, tensors.py the weights (quants.py decodes the
quantized block formats into layers/quantized.py's group form)."""
import glob
import os

from pdserve.errors import CheckpointError


def gguf_file(path: str) -> str | None:
    """The GGUF file a model path stands for, or None when it is not a GGUF model."""
    if os.path.isfile(path):
        return path if path.endswith(".gguf") or _has_magic(path) else None
    if not os.path.isdir(path) or os.path.exists(os.path.join(path, "config.json")):
        return None
    files = sorted(glob.glob(os.path.join(glob.escape(path), "*.gguf")))
    if len(files) > 1:
        raise CheckpointError(f"{path}: holds {len(files)} GGUF files ({', '.join(map(os.path.basename, files))}); "
                              "give the one to serve as the model path")
    return files[0] if files else None


def _has_magic(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False
