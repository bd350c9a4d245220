"""The device check's records, shared by benchmarks/device_check.py and its phases (each phase runs
in a process of its own and writes its JSON through these): atomic writes, reads that tolerate a
phase killed mid-way, the log's tail, a line of progress, a device sync before a clock is read."""
import json
import os
from datetime import datetime


def say(msg: str) -> None:
    print(f"[device_check {datetime.now():%H:%M:%S}] {msg}", flush=True)


def save(path: str, rec: dict) -> None:
    """Write JSON atomically: a reader (or a kill) never sees half a file."""
    tmp = f"{path}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(rec, f, indent=1, default=str)
    os.replace(tmp, path)


def load(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch
        torch.cuda.synchronize()


def log_tail(path: str, chars: int = 3000) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""
