"""One local two-node Ray cluster (one CPU per node) with Serve's HTTP proxy, for every Ray test
module: each deploys its own app on it and deletes it when done."""
import os
import socket

import pytest

# Big enough that hundreds of tokens take a while on one core (a kill must land mid-request).
SLOW = dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_model(make_tiny):
    return make_tiny("llama", **SLOW)


_start_failed: list[str] = []   # pytest sets a failed session fixture up again for each test: once is enough


@pytest.fixture(scope="session")
def ray_url():
    """The base URL of Serve's HTTP proxy on the cluster's head node."""
    if _start_failed:
        pytest.fail(f"the Ray cluster did not start: {_start_failed[0]}")
    ray = pytest.importorskip("ray", reason="Ray is not installed: pip install -e '.[ray]' (.ci/run installs it)")
    serve = pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[ray]'")
    from ray.cluster_utils import Cluster
    # A loaded machine starts a node's agents slowly: the raylet may wait longer for them (the
    # processes Ray starts inherit the variable).
    os.environ.setdefault("RAY_agent_register_timeout_ms", "120000")
    try:
        c, port = start_cluster(Cluster), free_port()
    except Exception as e:
        _start_failed.append(f"{type(e).__name__}: {e}")
        raise
    try:
        ray.init(address=c.address, log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port, "location": "HeadOnly"})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()
        c.shutdown()


def start_cluster(Cluster, attempts: int = 3):
    """The head and one more node. A node whose raylet has not registered within Ray's fixed 30 s
    (a starved machine) fails its start: the cluster is then started again."""
    for attempt in range(attempts):
        c = Cluster()
        try:
            c.add_node(num_cpus=1, object_store_memory=100 << 20, include_dashboard=False)   # the head
            c.add_node(num_cpus=1, object_store_memory=100 << 20)
            return c
        except Exception as e:
            c.shutdown()
            if attempt == attempts - 1 or "timed out during startup" not in str(e):
                raise
