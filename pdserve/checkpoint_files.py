"""Paths of a checkpoint's files, which must stay inside the checkpoint directory.

A checkpoint names some of its own files (the shards in model.safetensors.index.json), and any
of its files can be a symlink. A name that is absolute or climbs out with `..`, or a link that
resolves elsewhere, would make the server read a file the operator never meant to serve: a
chat_template.jinja linked to ~/.ssh/id_rsa would render into every chat prompt, and /tokenize
would hand it out. So every file is resolved here and refused if it leaves the directory.

The one exception is a Hugging Face cache snapshot (`.../models--org--name/snapshots/<rev>/`),
whose files are links into the same repository's `blobs/` folder.
"""
import json
import os

from pdserve.errors import CheckpointError


def _inside(path: str, root: str) -> bool:
    return os.path.commonpath([path, root]) == root


def checkpoint_file(model_dir: str, name: str) -> str:
    """`model_dir/name`, after checking that it resolves inside the checkpoint directory."""
    path = os.path.join(model_dir, name)
    parts = name.replace("\\", "/").split("/")
    if os.path.isabs(name) or ".." in parts:
        raise CheckpointError(f"{model_dir}: refers to {name!r}, outside the checkpoint directory; "
                              "pdserve reads model files only from the directory it was given")
    root = os.path.realpath(model_dir)
    real = os.path.realpath(path)
    allowed = [root]
    if os.path.basename(os.path.dirname(root)) == "snapshots":   # an HF cache snapshot
        allowed.append(os.path.join(os.path.dirname(os.path.dirname(root)), "blobs"))
    if not any(_inside(real, a) for a in allowed):
        raise CheckpointError(f"{path}: links to {real}, outside the checkpoint directory; "
                              "pdserve reads model files only from the directory it was given")
    return path


def read_json_object(path: str, error: type[Exception] = CheckpointError) -> dict | None:
    """The JSON object in the file, None if it does not exist; a one-line `error` if it is broken."""
    if not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise error(f"{path}: cannot read JSON ({str(e).splitlines()[0]})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
