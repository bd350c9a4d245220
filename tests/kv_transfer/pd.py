"""Helpers: a prefill engine and a decode engine in one process, driven the way the proxy drives
two servers (prefill with do_remote_decode, then decode with the returned kv_transfer_params)."""
import time

from pdserve.engine.llm_engine import LLMEngine
from pdserve.kv_transfer import KVTransferParams
from pdserve.sampling_params import SamplingParams
from tests.helpers import finish_all

SECRET = "a test deployment's KV transfer secret"   # every prefill and decode engine here holds it
ENGINE = dict(max_num_batched_tokens=64, max_num_seqs=16)   # the engines of the `pair` fixture


def greedy(max_tokens: int, **kv) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0,
                          kv_transfer_params=KVTransferParams(**kv) if kv else None)


def colocated(path: str, prompts, max_tokens: int, **engine_kwargs) -> list[list[int]]:
    engine = LLMEngine(path, **engine_kwargs)
    for i, p in enumerate(prompts):
        engine.add_request(f"c{i}", p, greedy(max_tokens))
    finals = finish_all(engine)
    return [finals[f"c{i}"].token_ids for i in range(len(prompts))]


def prefill(pre: LLMEngine, prompts, dec: LLMEngine) -> list[dict]:
    """Prefill every prompt on `pre` (one token, blocks leased for `dec`); their kv_transfer_params."""
    for i, p in enumerate(prompts):
        pre.add_request(f"p{i}", p, greedy(1, do_remote_decode=True, decode_engine_id=dec.connector.engine_id))
    finals = {}
    while pre.scheduler.has_unfinished():
        for out in pre.step():
            if out.finished:
                finals[out.request_id] = out
    return [finals[f"p{i}"].kv_transfer_params for i in range(len(prompts))]


def decode(dec: LLMEngine, prompts, params: list[dict], max_tokens: int, pre: LLMEngine | None = None,
           timeout: float = 60.0) -> dict:
    """Decode every prompt on `dec` from the prefill worker's params, stepping `pre` too (its
    leases are freed in its steps); the final outputs by request id d0, d1, ..."""
    for i, (p, kv) in enumerate(zip(prompts, params)):
        dec.add_request(f"d{i}", p, SamplingParams(max_tokens=max_tokens, temperature=0,
                                                    kv_transfer_params=KVTransferParams.from_dict(kv)))
    return drive(dec, pre, timeout)


def drive(dec: LLMEngine, pre: LLMEngine | None = None, timeout: float = 60.0) -> dict:
    finals, deadline = {}, time.monotonic() + timeout
    while dec.has_unfinished_requests() or (pre is not None and pre.has_unfinished_requests()):
        assert time.monotonic() < deadline, "the engines did not finish"
        for out in dec.step():
            if out.finished:
                assert out.request_id not in finals
                finals[out.request_id] = out
        if pre is not None:
            pre.step()
    return finals
