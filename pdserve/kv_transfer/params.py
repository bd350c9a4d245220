"""kv_transfer_params: what a request tells the engine about a remote KV cache (vLLM's field).

To a prefill worker: {"do_remote_decode": true, "decode_engine_id": ID}: keep the prompt's blocks
for the decode worker of that engine id (its GET /v1/kv_transfer says it).
To a decode worker: what the prefill worker's response returned: pull the first num_tokens - 1
prompt tokens' K/V from remote_host:remote_port (the KV listener), lease remote_request_id (a
random token, not the prefill request's id), made for decode_engine_id and the prompt of
prompt_hash, all signed by the prefill worker with the deployment's secret (auth.py)."""
from dataclasses import dataclass

from pdserve.errors import RequestError
from pdserve.kv_transfer import auth

TRANSPORTS = ("tcp", "shm")


@dataclass(frozen=True, slots=True)
class KVTransferParams:
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    num_tokens: int | None = None
    transport: str = "tcp"
    block_size: int | None = None
    dtype: str | None = None
    decode_engine_id: str | None = None
    prompt_hash: str | None = None
    signature: str | None = None

    def __post_init__(self):
        def bad(name, why):
            raise RequestError(f"kv_transfer_params.{name} {why}", param=f"kv_transfer_params.{name}")

        if self.do_remote_decode and self.do_remote_prefill:
            bad("do_remote_prefill", "and do_remote_decode cannot both be true")
        if self.transport not in TRANSPORTS:
            bad("transport", f"must be one of {', '.join(TRANSPORTS)}, got {self.transport!r}")
        if not self.do_remote_prefill:
            return
        for name in ("remote_host", "remote_request_id", "prompt_hash", "signature"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                bad(name, "must be a non-empty string with do_remote_prefill")
        if not isinstance(self.remote_port, int) or not 0 < self.remote_port < 65536:
            bad("remote_port", f"must be a TCP port (1 to 65535) with do_remote_prefill, got {self.remote_port!r}")
        if not isinstance(self.num_tokens, int) or self.num_tokens < 1:
            bad("num_tokens", f"must be an integer >= 1 with do_remote_prefill, got {self.num_tokens!r}")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            bad("block_size", f"must be an integer >= 1, got {self.block_size!r}")

    def signed_fields(self) -> dict:
        return {k: getattr(self, k) for k in auth.SIGNED}

    @property
    def active(self) -> bool:
        return self.do_remote_decode or self.do_remote_prefill

    @classmethod
    def from_dict(cls, d: dict) -> "KVTransferParams":
        """From a request body's object; unknown keys (another connector's) are ignored."""
        if not isinstance(d, dict):
            raise RequestError("kv_transfer_params must be an object", param="kv_transfer_params")
        known = {k: v for k, v in d.items() if k in cls.__dataclass_fields__ and v is not None}
        return cls(**known)
