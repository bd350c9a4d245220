"""Endpoints around generation: tokenize, detokenize, health, version, metrics."""
import functools

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from pdserve import __version__
from pdserve.errors import RequestError
from pdserve.server.errors import error_body
from pdserve.server.metrics import CONTENT_TYPE
from pdserve.server.protocol import DetokenizeRequest, TokenizeRequest
from pdserve.server.reasoning import check_template_kwargs
from pdserve.server.admission import OFFLOAD_CHARS, get_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request):
    s = get_state(request)
    if (body.prompt is None) == (body.messages is None):
        raise RequestError("give exactly one of `prompt` and `messages`", param="prompt")
    if body.messages is not None:
        tokens = await s.encode_chat([m.as_template_dict() for m in body.messages],
                                     add_generation_prompt=body.add_generation_prompt,
                                     **check_template_kwargs(body.chat_template_kwargs))
    else:
        s.check_prompt_chars([body.prompt])
        tokenize = functools.partial(s.tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        tokens = tokenize() if len(body.prompt) <= OFFLOAD_CHARS else await s.offload(tokenize)
    return {"tokens": tokens, "count": len(tokens), "max_model_len": s.max_model_len}


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request):
    tok = get_state(request).tokenizer
    bad = [i for i in body.tokens if not 0 <= i < tok.vocab_size]
    if bad:   # the tokenizer would silently drop them
        raise RequestError(f"tokens has ids outside the vocabulary [0, {tok.vocab_size}): {bad[:5]}", param="tokens")
    return {"prompt": tok.decode(body.tokens)}


@router.get("/health")
async def health(request: Request):
    engine = get_state(request).async_engine
    if not engine.alive:
        why = f"engine loop failed: {engine.error!r}" if engine.error else "engine loop is not running"
        return JSONResponse(error_body(why, type="server_error", code="engine_dead"), status_code=503)
    if not engine.accepting:   # draining after SIGTERM: tell load balancers to go elsewhere
        return JSONResponse(error_body("shutting down", type="server_error", code="shutting_down"), status_code=503)
    return {"status": "ok"}


@router.get("/version")
async def version():
    return {"version": __version__}


@router.post("/reset_prefix_cache")
async def reset_prefix_cache(request: Request):
    """Forget every cached block no running request holds (vLLM's endpoint). Never refused for
    running requests: the blocks they hold stay cached, and the answer says how many."""
    s = get_state(request)
    if s.paged is None:
        raise RequestError(f"the {s.engine.name} baseline has no prefix cache", param=None)
    return await s.async_engine.call(s.paged.reset_prefix_cache)


@router.get("/v1/kv_transfer")
async def kv_transfer(request: Request):
    """This worker's prefill/decode role and KV layout, for a proxy pairing workers (docs/API.md)."""
    s = get_state(request)
    if s.paged is None:   # a baseline: no paged cache to transfer
        return {"role": "both", "engine_id": None, "block_size": None, "dtype": None, "transport": None,
                "kv_host": None, "kv_port": None, "model": s.config.served_model_name}
    return {**s.paged.kv_transfer_info(), "model": s.config.served_model_name}


@router.get("/metrics")
async def metrics(request: Request):
    return Response(get_state(request).metrics.render(), media_type=CONTENT_TYPE)
