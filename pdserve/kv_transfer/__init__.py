"""Prefill/decode disaggregation: moving a prompt's KV cache from a prefill worker to a decode
worker (connector.py: the interface and the engine's side; tcp.py and shm.py: the transports;
lease.py: the prefill worker's kept blocks; layout.py: where the bytes are; frames.py: the wire)."""
from pdserve.kv_transfer.connector import KVConnectorBase, LoadResult, PDConnector
from pdserve.kv_transfer.layout import KVLayout
from pdserve.kv_transfer.params import KVTransferParams

ROLES = ("both", "prefill", "decode")


def make_connector(config, kv_cache, dtype: str) -> PDConnector | None:
    """The connector of an engine with --role prefill or decode (None for both: no transfer)."""
    if config.role == "both":
        return None
    return PDConnector(config.role, KVLayout(kv_cache), config.block_size, dtype, host=config.kv_transfer_host,
                       port=config.kv_transfer_port, transport=config.kv_transport, lease_s=config.kv_lease_s)


__all__ = ["KVConnectorBase", "KVLayout", "KVTransferParams", "LoadResult", "PDConnector", "ROLES", "make_connector"]
