"""The endpoints of the teaching server pdserve grew out of, with its field names.

They are served by the same engine as the OpenAI API (their requests share steps with
everyone else's) and default to greedy decoding of up to 64 tokens.

One deliberate change: /generate returns only the continuation, like /basic_generate,
/generate_stream and the OpenAI endpoints. The origin returned prompt + continuation because
it decoded the whole sequence with HF; that re-decoded prompt need not even equal the text
the client sent (tokenization does not always round-trip), and no other endpoint echoed it.
"""
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from pdserve.server.errors import APIError
from pdserve.server.protocol import BasicGenerateRequest, GenerateRequest, GenerateStreamRequest
from pdserve.server.admission import get_state
from pdserve.server.streaming import sse, sse_response, unless_disconnected

router = APIRouter()


async def _submit(request: Request, body, prompts: list[str], param: str = "prompt", stream: bool = False):
    arrival = time.perf_counter()
    s = get_state(request)
    s.check_queue(len(prompts), param)   # before the tokenizer: a full queue is refused at once
    fields = body.model_fields_set
    max_tokens = s.request_max_tokens(body.max_tokens if "max_tokens" in fields else None, body.max_tokens,
                                      len(prompts), None)
    s.check_cost(len(prompts), max_tokens, None)
    ids = await s.encode(prompts, param)
    s.check_prompt_len(ids, param)
    # a max_tokens the client gave is refused past the context, as the OpenAI endpoints do; the default is not
    def room(prompt: list[int]) -> int:
        return max_tokens if "max_tokens" in fields else s.default_within_context(max_tokens, prompt)
    # the origin's greedy default gives way to generation_config.json's temperature, a request's to neither
    asked = {"temperature": body.temperature} if "temperature" in fields else {}
    params = [p for i in ids for p in s.sampling_params(1, None, fallback={"temperature": body.temperature},
                                                        max_tokens=room(i), final_only=not stream, **asked)]
    _, sub = await s.submit(ids, params, arrival, "gen")
    return sub


async def _texts(sub) -> list[str]:
    return [out.text for out in await sub.collect()]


@router.post("/basic_generate")
async def basic_generate(body: BasicGenerateRequest, request: Request):
    sub = await _submit(request, body, [body.prompt])

    async def work():
        return JSONResponse({"generated_text": (await _texts(sub))[0]})
    return await unless_disconnected(request, work())


@router.post("/generate")
async def generate(body: GenerateRequest, request: Request):
    sub = await _submit(request, body, body.prompts, "prompts")

    async def work():
        return JSONResponse({"generated_texts": await _texts(sub)})   # in input order
    return await unless_disconnected(request, work())


@router.post("/generate_stream")
async def generate_stream(body: GenerateStreamRequest, request: Request):
    sub = await _submit(request, body, [body.prompt], stream=True)

    async def events():
        # The origin's stream is only token events; it ends when the response ends.
        try:
            async for out in sub.outputs():
                if out.new_text:
                    yield sse({"token": out.new_text, "sequence_id": out.request_id})
        except APIError as e:
            yield sse({"error": e.message, "sequence_id": sub.request_ids[0]})
        finally:
            sub.cancel()
    return sse_response(events())
