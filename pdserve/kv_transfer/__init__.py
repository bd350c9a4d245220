"""Prefill/decode disaggregation: moving a prompt's KV cache from a prefill worker to a decode
worker (connector.py: the interface and the engine's side; tcp.py and shm.py: the transports;
lease.py: the prefill worker's kept blocks; layout.py: where the bytes are; frames.py: the wire;
auth.py: the deployment's secret, who may pull what)."""
import logging

from pdserve.kv_transfer.auth import parse_peers
from pdserve.kv_transfer.connector import KVConnectorBase, LoadResult, PDConnector
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.params import KVTransferParams

ROLES = ("both", "prefill", "decode")


def make_connector(config, runner, dtype: str) -> PDConnector | None:
    """The connector of an engine with --role prefill or decode (None for both: no transfer)."""
    if config.role == "both":
        return None
    transport = config.kv_transport if runner.kv_cache_file is not None or config.role != "prefill" else "tcp"
    if transport != config.kv_transport:   # a GPU cache is not in a /dev/shm file
        logging.getLogger("pdserve.kv_transfer").warning("--kv-transport shm needs a CPU KV cache; using tcp")
    return PDConnector(config.role, KVLayout(runner.kv_cache), config.block_size, dtype,
                       secret=config.kv_transfer_secret, host=config.kv_transfer_host, port=config.kv_transfer_port,
                       transport=transport, lease_s=config.kv_lease_s, cache_file=runner.kv_cache_file,
                       engine_id=config.kv_engine_id, peers=parse_peers(config.kv_transfer_peers))


__all__ = ["KVConnectorBase", "KVLayout", "KVTransferParams", "LoadResult", "PDConnector", "ROLES", "make_connector"]
