"""`pdserve serve --ray --host 127.0.0.1` starts a local Ray instance whose every listening socket
(GCS, raylet, object manager, agents, dashboard, each worker's gRPC port, Serve's HTTP proxy) is
on loopback, read from /proc for the processes it started."""
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

from pdserve.ray.listen import node_ip_for


def descendants(root: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue   # gone meanwhile
            children.setdefault(ppid, []).append(int(entry))
    found, todo = set(), [root]
    while todo:
        pid = todo.pop()
        found.add(pid)
        todo += children.get(pid, [])
    return found


def socket_inodes(pids: set[int]) -> dict[int, int]:
    """inode -> pid of every socket the processes hold (PermissionError if not readable)."""
    inodes = {}
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except FileNotFoundError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except FileNotFoundError:
                continue
            if target.startswith("socket:["):
                inodes[int(target[8:-1])] = pid
    return inodes


def address(hex_ip: str) -> str:
    raw = bytes.fromhex(hex_ip)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))   # each 32-bit word is host order
    return socket.inet_ntop(socket.AF_INET if len(raw) == 4 else socket.AF_INET6, raw)


def listening(pids: set[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket the processes listen on."""
    inodes = socket_inodes(pids)
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and int(fields[9]) in inodes:   # 0A: LISTEN
                    ip, port = fields[1].split(":")
                    found.append((address(ip), int(port, 16), inodes[int(fields[9])]))
    return found


def process_name(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as f:
        return f"{f.read().strip()}[{pid}]"


def loopback(ip: str) -> bool:
    return ip.startswith("127.") or ip in ("::1", "::ffff:127.0.0.1") or ip.startswith("::ffff:127.")


def test_the_node_ip_follows_the_host():
    assert node_ip_for("127.0.0.1") == node_ip_for("localhost") == node_ip_for("::1") == "127.0.0.1"
    assert node_ip_for("10.1.2.3") == "10.1.2.3"
    assert node_ip_for("0.0.0.0") is None and node_ip_for("::") is None and node_ip_for("node7") is None


def test_a_local_ray_instance_listens_on_loopback_only(tiny_llama, tmp_path):
    pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (.ci/run installs it)")
    if not (os.path.exists("/proc/net/tcp") and os.path.isdir(f"/proc/{os.getpid()}/fd")):
        pytest.skip("listening sockets are read from /proc (Linux), which this system does not have")
    from tests.ray.conftest import free_port

    port = free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env.setdefault("RAY_agent_register_timeout_ms", "120000")   # a loaded machine starts the agents slowly
    proc = subprocess.Popen([sys.executable, "-m", "pdserve", "serve", "--model", tiny_llama, "--ray", "--host",
                             "127.0.0.1", "--port", str(port), "--max-model-len", "128", "--shutdown-timeout", "5"],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + 600
        while "serving" not in log.read_text():
            assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        assert httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=120).status_code == 200
        pids = descendants(proc.pid)
        try:
            sockets = [(ip, port, process_name(pid)) for ip, port, pid in listening(pids)]
        except PermissionError as e:
            pytest.skip(f"cannot read the sockets of Ray's processes: {e}")
    finally:
        proc.terminate()
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    ports = {p for _, p, _ in sockets}
    assert port in ports and len(ports) >= 5, sockets   # Serve's HTTP proxy, the GCS, the raylet, ...
    # Ray Serve opens each replica's inter-deployment gRPC server on [::]:0, a fixed address
    # (docs/RAY.md): one such port per replica process, and nothing else, may be beyond loopback
    open_ = [(ip, p, name) for ip, p, name in sockets if not loopback(ip)]
    replicas = [name for _, _, name in open_ if name.startswith("ray::ServeRepli")]
    assert len(replicas) == len(set(replicas)) and len(replicas) == len(open_), f"beyond loopback: {open_}"
