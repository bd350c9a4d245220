"""OpenAI-compatible endpoints: /v1/completions, /v1/chat/completions, /v1/models.

One HTTP request becomes len(prompts) x n engine requests; choice i of the response is
engine request `{id}-{i}`. Each choice carries its phase timings as the extension field
"metrics" (RequestMetrics.as_dict()), in the response or in the stream chunk that ends it.
"""
import json
import math
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import Response

from pdserve.engine.outputs import RequestOutput
from pdserve.errors import RequestError
from pdserve.server.errors import APIError, error_body
from pdserve.server.protocol import ChatCompletionRequest, CompletionRequest
from pdserve.server import reasoning, tool_calls
from pdserve.server.admission import ServerState, get_state
from pdserve.server.streaming import DONE, sse, sse_response, unless_disconnected
from pdserve.server.structured import check_grammar

router = APIRouter()

# A response with more token entries (tokens x (1 + logprobs)) than this is built on a worker thread.
BUILD_INLINE_TOKENS = 2048
# JSON has no -inf; a token masked out by top-k/top-p reports this instead (as vLLM does).
MASKED_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MASKED_LOGPROB


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's dict holds the top k plus the sampled token, which may be outside them.
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(tok, token_ids: list[int], logprobs: list[dict | None], k: int, offset: int) -> dict:
    """The legacy completions logprobs object for these tokens; `offset` is the text length before them.
    An entry None (the first prompt token's, which has no context) is null, as OpenAI and vLLM send it."""
    res = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, lp in zip(token_ids, logprobs):
        s = tok.decode([tid], skip_special_tokens=False)
        res["tokens"].append(s)
        res["text_offset"].append(offset)
        offset += len(s)
        if lp is None:
            res["token_logprobs"].append(None)
            res["top_logprobs"].append(None)
            continue
        res["token_logprobs"].append(_finite(lp[tid]))
        top = {}
        for i, v in _top(lp, k):   # best first: ids that decode to the same string keep the best value
            top.setdefault(tok.decode([i], skip_special_tokens=False), _finite(v))
        res["top_logprobs"].append(top)
    return res


def _prompt_floats(out: RequestOutput) -> list[dict | None]:
    """The prompt's logprobs as the output's are, {token_id: logprob}; an entry the engine did not
    make (a request cut short) is null."""
    entries = out.prompt_logprobs or []
    floats = [None if e is None else {t: lp.logprob for t, lp in e.items()} for e in entries]
    return floats + [None] * (len(out.prompt_token_ids) - len(floats))


def prompt_logprobs_json(out: RequestOutput) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token null (the first) or {token_id: {logprob, rank,
    decoded_token}} for the token and its alternatives."""
    return [None if e is None else {str(t): {"logprob": _finite(lp.logprob), "rank": lp.rank,
                                             "decoded_token": lp.decoded_token} for t, lp in e.items()}
            for e in out.prompt_logprobs or []]


def chat_logprobs(tok, token_ids: list[int], logprobs: list[dict], k: int) -> list[dict]:
    """The chat `logprobs.content` entries for these tokens."""
    def entry(tid, value):
        s = tok.decode([tid], skip_special_tokens=False)
        return {"token": s, "logprob": _finite(value), "bytes": list(s.encode())}
    return [{**entry(tid, lp[tid]), "top_logprobs": [entry(i, v) for i, v in _top(lp, k)]}
            for tid, lp in zip(token_ids, logprobs)]


def _usage(prompts: list[list[int]], num_generated: int, num_cached: int = 0) -> dict:
    n_prompt = sum(len(p) for p in prompts)
    return {"prompt_tokens": n_prompt, "completion_tokens": num_generated, "total_tokens": n_prompt + num_generated,
            "prompt_tokens_details": {"cached_tokens": num_cached}}


def _cached(outputs, n: int) -> int:
    """Prompt tokens served from the prefix cache: each prompt's first choice's (the prompt counts once)."""
    return sum(o.num_cached_tokens for i, o in enumerate(outputs) if i % n == 0 and o is not None)


def _ending(out: RequestOutput, score_only: bool = False) -> dict:
    if score_only:   # max_tokens 0: the limit ended it, whatever stopped the one token it ran
        return {"finish_reason": "length", "stop_reason": None, "metrics": out.metrics.as_dict()}
    return {"finish_reason": out.finish_reason, "stop_reason": out.stop_reason, "metrics": out.metrics.as_dict()}


def _head(request_id: str, object: str, s: ServerState) -> dict:
    return {"id": request_id, "object": object, "created": int(time.time()), "model": s.config.served_model_name}


def _check_remote_decode(body, num_seqs: int) -> None:
    """A prefill worker's request (kv_transfer_params.do_remote_decode) leases one prompt's blocks
    and returns where they are in its one response body."""
    if body.remote_decode and (num_seqs != 1 or body.stream):
        raise RequestError("kv_transfer_params.do_remote_decode needs one prompt, n 1 and stream false",
                           param="kv_transfer_params.do_remote_decode")


def _kv_transfer(choices: list[RequestOutput]) -> dict:
    """The prefill worker's kv_transfer_params, at the top level of its response (as vLLM's)."""
    params = choices[0].kv_transfer_params if len(choices) == 1 else None
    return {"kv_transfer_params": params} if params is not None else {}


def _refuse_unsupported(body, fields: tuple[str, ...]) -> None:
    for f in fields:
        if getattr(body, f) is not None:
            raise RequestError(f"{f} is not supported by this server", param=f)


# ---- /v1/completions

@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request):
    arrival = time.perf_counter()
    s = get_state(request)
    s.check_model(body.model)
    s.check_stop(body.stop_list, body.stop_token_ids)
    s.check_n(body.n)
    s.check_logprobs(body.logprobs, "logprobs")
    s.check_logprobs(body.prompt_logprobs, "prompt_logprobs")
    prompt_k, k_param = _completion_prompt_logprobs(body)
    s.check_prompt_logprobs(prompt_k, k_param)
    # max_tokens 0 with echo (OpenAI's, vLLM's): the prompt and its logprobs only, nothing
    # generated; the engine runs one token, which is dropped (scoring, perplexity)
    score_only = body.echo and body.max_tokens == 0
    num_seqs = (1 if isinstance(body.prompt, str) or isinstance(body.prompt[0], int) else len(body.prompt)) * body.n
    _check_remote_decode(body, num_seqs)
    s.check_queue(num_seqs, "n" if body.n > 1 else "prompt")   # before the tokenizer: a full queue is refused at once
    grammar = body.grammar_spec()
    await check_grammar(s.engine, grammar)
    if score_only:
        max_tokens = 1
    else:   # left out, max_tokens is OpenAI's (and vLLM's) 16; only an explicit null takes max_new_tokens, as vLLM
        max_tokens = s.request_max_tokens(body.max_tokens, 16, num_seqs, body.logprobs,
                                          generation="max_tokens" in body.model_fields_set)
    s.check_cost(num_seqs, max_tokens, body.logprobs)
    prompts = await s.prompt_ids(body.prompt)
    s.check_prompt_len(prompts)
    s.check_prompt_cost(num_seqs, max_tokens, body.logprobs, prompts, body.n, prompt_k, k_param)
    params = [p for _ in prompts for p in s.sampling_params(body.n, body.seed, max_tokens=max_tokens,
                                                            logprobs=body.logprobs, prompt_logprobs=prompt_k,
                                                            final_only=not body.stream, grammar=grammar,
                                                            **body.sampling_kwargs())]
    if not body.echo:
        texts = [""] * len(prompts)
    elif isinstance(body.prompt, str) or isinstance(body.prompt[0], str):
        texts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    else:
        texts = [s.tokenizer.decode(p) for p in prompts]
    echo = [t for t in texts for _ in range(body.n)]   # per choice
    request_id, sub = await s.submit([p for p in prompts for _ in range(body.n)], params, arrival, "cmpl")
    head = _head(request_id, "text_completion", s)
    if body.stream:
        return sse_response(_completion_events(s, body, sub, head, prompts, echo, score_only))
    return await unless_disconnected(request, _completion_response(s, body, sub, head, prompts, echo, score_only))


def _completion_prompt_logprobs(body) -> tuple[int | None, str]:
    """The prompt logprobs a completion asks the engine for, and the field that asked: vLLM's
    prompt_logprobs, or echo with logprobs (the echoed prompt tokens come with theirs: how
    lm-evaluation-harness scores choices). A streamed response has no place for prompt_logprobs
    (vLLM refuses them too); echo with logprobs sends them in the first chunk."""
    if body.max_tokens == 0 and not body.echo:
        raise RequestError("max_tokens must be >= 1 (0 only with echo: the prompt, and its logprobs, without a "
                           "completion)", param="max_tokens")
    if body.stream and body.prompt_logprobs:
        raise RequestError("prompt_logprobs are not available with stream (use echo with logprobs: the first "
                           "chunk carries the prompt's logprobs)", param="prompt_logprobs")
    echoed = body.logprobs if body.echo else None
    if body.prompt_logprobs is not None and not body.stream:
        return max(body.prompt_logprobs, echoed or 0), "prompt_logprobs"
    return echoed, "logprobs"


async def _json_response(s, choices: list[RequestOutput], logprobs: int | None, build) -> Response:
    """The response body build() makes, encoded; on a worker thread when it is big (many tokens,
    or logprobs), so the loop keeps answering while a large response is built."""
    def encode() -> bytes:
        return json.dumps(build(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode()
    size = sum(len(c.token_ids) + (len(c.prompt_token_ids) if c.prompt_logprobs else 0)
               for c in choices) * (1 + (logprobs or 0))
    body = encode() if size <= BUILD_INLINE_TOKENS else await s.offload(encode)
    return Response(body, media_type="application/json")


def _completion_tokens(c: RequestOutput, body, score_only: bool) -> tuple[list[int], list | None]:
    """A choice's tokens and logprobs as the response shows them: with echo and logprobs the
    prompt's first; with max_tokens 0 only the prompt's."""
    ids, lps = ([], []) if score_only else (c.token_ids, c.logprobs)
    if body.echo and body.logprobs is not None:
        ids, lps = list(c.prompt_token_ids) + ids, _prompt_floats(c) + lps
    return ids, lps


async def _completion_response(s, body, sub, head, prompts, echo, score_only) -> Response:
    choices = await sub.collect()

    def build() -> dict:
        res = []
        for i, c in enumerate(choices):
            ids, lps = _completion_tokens(c, body, score_only)
            lp = None if body.logprobs is None else completion_logprobs(s.tokenizer, ids, lps, body.logprobs, 0)
            choice = {"index": i, "text": echo[i] + ("" if score_only else c.text), "logprobs": lp,
                      **_ending(c, score_only)}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(c)
            res.append(choice)
        generated = 0 if score_only else sum(len(c.token_ids) for c in choices)
        usage = _usage(prompts, generated, _cached(choices, body.n))
        return {**head, "choices": res, "usage": usage, **_kv_transfer(choices)}
    return await _json_response(s, choices, _entries_per_token(body), build)


def _entries_per_token(body) -> int | None:
    """Logprob entries per token of the response, for _json_response's size (prompt ones included)."""
    if body.logprobs is None and body.prompt_logprobs is None:
        return None
    return max(body.logprobs or 0, body.prompt_logprobs or 0)


async def stream_choices(sub, head: dict, opening: list[dict], choices_of, usage_of) -> AsyncIterator[str]:
    """The SSE stream completions and chat share: the opening choices, then for every engine
    output the choices `choices_of(out, i)` makes of it (i: its choice index), then the usage
    (`usage_of(finals)`, None: not asked for), then [DONE]. An API error ends the stream with an
    error event; a client that leaves early frees the KV blocks (sub.cancel)."""
    try:
        for choice in opening:
            yield sse({**head, "choices": [choice]})
        finals = [None] * len(sub.request_ids)
        async for out in sub.outputs():
            i = sub.index[out.request_id]
            if out.finished:
                finals[i] = out
            for choice in choices_of(out, i):
                yield sse({**head, "choices": [choice]})
        usage = usage_of(finals)
        if usage is not None:
            yield sse({**head, "choices": [], "usage": usage})
    except APIError as e:
        yield sse(error_body(e.message, e.type, e.param, e.code))
    finally:
        sub.cancel()   # a no-op unless the client left early
    yield DONE


def _has_news(out: RequestOutput) -> bool:
    # one event per new token, even when its text is still empty (part of a character, or held
    # back as a possible stop string), as vLLM does: clients time tokens by events
    return bool(out.new_token_ids or out.new_text or out.finished)


def _stream_usage(body, prompts: list[list[int]], score_only: bool = False):
    def usage_of(finals: list[RequestOutput | None]) -> dict | None:
        if not body.include_usage:
            return None
        generated = 0 if score_only else sum(len(f.token_ids) for f in finals if f is not None)
        return _usage(prompts, generated, _cached(finals, body.n))
    return usage_of


def _completion_events(s, body, sub, head, prompts, echo, score_only):
    # per choice, for logprobs' text_offset: advanced by each token's own text, as the
    # non-streamed response counts it (a token's text and the stream's text differ when
    # tokens split a character)
    offsets = [len(e) for e in echo]
    # echo with logprobs: the prompt goes with the first output, which brings its logprobs (as
    # vLLM's stream); without logprobs it opens the stream at once
    echo_first = body.echo and body.logprobs is not None
    pending = [echo_first] * len(echo)
    if echo_first:
        offsets = [0] * len(echo)

    def choices_of(out: RequestOutput, i: int):
        ids, lps, text = ([], [], "") if score_only else (out.new_token_ids, out.new_logprobs, out.new_text)
        if pending[i]:
            pending[i] = False
            ids, lps, text = list(out.prompt_token_ids) + ids, _prompt_floats(out) + lps, echo[i] + text
        choice = {"index": i, "text": text, "logprobs": None, "finish_reason": None}
        if body.logprobs is not None and ids:
            choice["logprobs"] = completion_logprobs(s.tokenizer, ids, lps, body.logprobs, offsets[i])
            offsets[i] += sum(len(t) for t in choice["logprobs"]["tokens"])
        if out.finished:
            choice.update(_ending(out, score_only))
        return [choice] if (_has_news(out) and not score_only) or out.finished else []

    opening = [] if echo_first else [{"index": i, "text": text, "logprobs": None, "finish_reason": None}
                                     for i, text in enumerate(echo) if text]
    return stream_choices(sub, head, opening, choices_of, _stream_usage(body, prompts, score_only))


# ---- /v1/chat/completions

@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request):
    arrival = time.perf_counter()
    s = get_state(request)
    s.check_model(body.model)
    _refuse_unsupported(body, ("continue_final_message",))
    s.check_stop(body.stop_list, body.stop_token_ids)
    s.check_n(body.n)
    s.check_logprobs(body.top_logprobs, "top_logprobs")
    if body.top_logprobs is not None and not body.logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", param="top_logprobs")
    _check_remote_decode(body, body.n)
    if body.stream and body.prompt_logprobs:   # as vLLM: a stream has no place for them
        raise RequestError("prompt_logprobs are not available with stream", param="prompt_logprobs")
    prompt_k = None if body.stream else body.prompt_logprobs
    s.check_prompt_logprobs(prompt_k, "prompt_logprobs")
    s.check_queue(body.n)   # before the template and the tokenizer: a full queue is refused at once
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    if body.max_completion_tokens is not None or body.max_tokens is not None:
        s.check_cost(body.n, body.max_completion_tokens or body.max_tokens, logprobs)
    harmony = s.reasoning is not None and s.reasoning.harmony
    tools = tool_calls.plan(body, s.config.tool_call_parser, harmony) \
        if body.tools is not None or body.tool_choice is not None else tool_calls.NO_TOOLS
    grammar = body.grammar_spec()
    if tools.grammar is not None:
        if grammar is not None:
            raise RequestError(f"{grammar.param} cannot be combined with a tool_choice that constrains the "
                               "answer (required or a named function)", param=grammar.param)
        grammar = tools.grammar
    await check_grammar(s.engine, grammar)
    messages, extra = body.template_input(tools.tools)
    prompt = await render_prompt(s, messages, extra, body.reasoning_effort)
    if not prompt:
        raise RequestError("messages render to an empty prompt", param="messages")
    think, extra_params = await reasoning_start(s, messages, extra, grammar, body.stop_token_ids)
    s.check_prompt_len([prompt], param="messages")
    # OpenAI's chat default: as many as can be served, within the context and the KV cache (or
    # max_new_tokens), and --max-request-cost with what prompt logprobs take of it. If the prompt
    # alone is too long, asking for one token lets the engine report the lengths.
    room = s.max_seq_len - len(prompt)
    max_tokens = s.request_max_tokens(body.max_completion_tokens if body.max_completion_tokens is not None
                                      else body.max_tokens, room, body.n, logprobs, room=room,
                                      spent=s.prompt_cost([prompt], body.n, prompt_k))
    s.check_prompt_cost(body.n, max_tokens, logprobs, [prompt], body.n, prompt_k, "prompt_logprobs")
    sampling = {**body.sampling_kwargs(), **extra_params}   # extra_params' stop_token_ids include the request's
    params = s.sampling_params(body.n, body.seed, max_tokens=max_tokens, logprobs=logprobs, prompt_logprobs=prompt_k,
                               final_only=not body.stream, grammar=grammar, **sampling)
    request_id, sub = await s.submit([prompt] * body.n, params, arrival, "chatcmpl")
    if body.stream:
        return sse_response(_chat_events(s, body, sub, _head(request_id, "chat.completion.chunk", s), prompt, tools,
                                         think))
    return await unless_disconnected(
        request, _chat_response(s, body, sub, _head(request_id, "chat.completion", s), prompt, tools, think))


async def render_prompt(s: ServerState, messages: list[dict], template_kwargs: dict, effort: str | None,
                        effort_param: str = "reasoning_effort") -> list[int]:
    """The prompt's token ids: the chat template's, or harmony's (--reasoning-parser gpt_oss),
    which renders the tools and the reasoning effort itself and has no template to pass kwargs to."""
    if s.reasoning is None or not s.reasoning.harmony:
        if effort is not None:
            raise RequestError(f"{effort_param} needs a server started with --reasoning-parser gpt_oss",
                               param=effort_param)
        return await s.encode_chat(messages, add_generation_prompt=True, **template_kwargs)
    if set(template_kwargs) - {"tools"}:
        raise RequestError("chat_template_kwargs are not used with --reasoning-parser gpt_oss (harmony renders "
                           "the prompt, not a template)", param="chat_template_kwargs")
    s.check_prompt_chars(["".join(m["content"] for m in messages)], "messages")
    return await s.offload(lambda: s.reasoning.render(messages, template_kwargs.get("tools", []), effort))


async def reasoning_start(s: ServerState, messages: list[dict], template_kwargs: dict, grammar,
                          stop_token_ids: list[int] | None = None) -> tuple[str | None, dict]:
    """With --reasoning-parser: where the prompt leaves the model (thinking on, off, already open;
    None without a parser), and the SamplingParams that start the grammar after the thinking (gpt_oss:
    that stop at harmony's end-of-action tokens, besides the request's stop_token_ids)."""
    if s.reasoning is not None and s.reasoning.harmony:
        if grammar is not None:
            raise RequestError("structured outputs are not supported with --reasoning-parser gpt_oss (no one token "
                               "starts the answer's channel, for a grammar to start after)", param=grammar.param)
        return reasoning.OPEN, {"stop_token_ids": list(stop_token_ids or []) + s.reasoning.stop_token_ids}
    think = None if s.reasoning is None else await s.offload(
        lambda: reasoning.chat_prompt_state(s.reasoning, s.tokenizer, messages, **template_kwargs))
    if think is not None and grammar is not None:   # the grammar constrains the answer, not the thinking
        after = s.reasoning.grammar_after_token(think)
        return think, {} if after is None else {"grammar_after_token": after}
    return think, {}


def _tool_finish(ending: dict, has_calls: bool) -> dict:
    # OpenAI ends an answer that calls tools with "tool_calls"
    return {**ending, "finish_reason": "tool_calls"} if has_calls and ending["finish_reason"] == "stop" else ending


async def _chat_response(s, body, sub, head, prompt, tools, think) -> Response:
    choices = await sub.collect()
    k = body.top_logprobs or 0

    def build() -> dict:
        res = []
        for i, c in enumerate(choices):
            message, ending = _chat_message(s, c, tools, think)
            lp = {"content": chat_logprobs(s.tokenizer, c.token_ids, c.logprobs, k)} if body.logprobs else None
            res.append({"index": i, "message": message, "logprobs": lp, **ending})
        usage = _usage([prompt], sum(len(c.token_ids) for c in choices), _cached(choices, body.n))
        # vLLM's place for them in a chat response: once, at the top (every choice has the same prompt)
        extra = {"prompt_logprobs": prompt_logprobs_json(choices[0])} if body.prompt_logprobs is not None else {}
        return {**head, "choices": res, "usage": usage, **extra, **_kv_transfer(choices)}
    return await _json_response(s, choices, max(k if body.logprobs else 0, body.prompt_logprobs or 0), build)


def answer_fields(s, tools, think, c: RequestOutput) -> dict:
    """A finished answer as a chat message's fields (content, the reasoning under both names with a
    --reasoning-parser, tool_calls where it made some): the reasoning split off, the tool calls
    parsed. The Responses API builds its output from the same fields."""
    if think is not None and s.reasoning.harmony:   # from the tokens, harmony's markers included
        return s.reasoning.message(c.token_ids)
    text, thought = c.text, {}
    if think is not None:   # the answer is what follows the thinking
        r, text = s.reasoning.split(c.text, think)
        thought = reasoning.message_fields(r)
    if tools.mode == "none" or text is None:
        return {"content": text, **thought}
    content, calls = tool_calls.extract(tools, text, c.finish_reason)
    return {"content": content, **thought, **({"tool_calls": calls} if calls else {})}


def _chat_message(s, c: RequestOutput, tools, think) -> tuple[dict, dict]:
    """A finished choice's message and ending ("tool_calls" where it called some)."""
    message = {"role": "assistant", **answer_fields(s, tools, think, c)}
    return message, _tool_finish(_ending(c), "tool_calls" in message)


class AnswerStream:
    """One streamed answer as chat deltas (chat's stream and the Responses API's both read them):
    the reasoning first (--reasoning-parser), then the answer's content or its tool calls; with
    harmony (gpt_oss) its parser makes them all from the tokens."""

    def __init__(self, s: ServerState, plan: tool_calls.ToolPlan, think: str | None):
        self.harmony = think is not None and s.reasoning.harmony
        self.thinking = None if think is None else s.reasoning.stream(think)
        self.calls = tool_calls.ToolStream(plan) if plan.mode != "none" and not self.harmony else None

    def feed(self, out: RequestOutput) -> list[dict]:
        if self.harmony:
            return self.thinking.feed(out.new_token_ids, out.finished)
        text, deltas = out.new_text, []
        if self.thinking is not None:   # reasoning deltas first; the answer's text goes on as content
            d = self.thinking.feed(text, out.finished)
            if d.reasoning:
                deltas.append(reasoning.message_fields(d.reasoning))
            text = d.content
        if self.calls is None:
            return deltas + ([{"content": text}] if text else [])
        return deltas + (self.calls.deltas(text, out.finished, out.finish_reason) if text or out.finished else [])

    def ending(self, out: RequestOutput) -> dict:
        """The finished answer's finish_reason (tool_calls where it made calls) and stop_reason."""
        calls = self.thinking if self.harmony else self.calls
        return _ending(out) if calls is None else _tool_finish(_ending(out), calls.has_calls())


def _chat_events(s, body, sub, head, prompt, tools, think):
    answers = [AnswerStream(s, tools, think) for _ in range(body.n)]

    def choices_of(out: RequestOutput, i: int):
        deltas = answers[i].feed(out)
        # a finished answer's tool calls: one event each, before the last delta
        events = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas[:-1]]
        choice = {"index": i, "delta": deltas[-1] if deltas else {}, "logprobs": None, "finish_reason": None}
        if body.logprobs and out.new_token_ids:
            choice["logprobs"] = {"content": chat_logprobs(s.tokenizer, out.new_token_ids, out.new_logprobs,
                                                           body.top_logprobs or 0)}
        if out.finished:
            choice.update(answers[i].ending(out))
        return events + ([choice] if _has_news(out) else [])

    opening = [{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
               for i in range(body.n)]
    return stream_choices(sub, head, opening, choices_of, _stream_usage(body, [prompt]))


# ---- /v1/models

def _model_card(s: ServerState) -> dict:
    return {"id": s.config.served_model_name, "object": "model", "created": s.created, "owned_by": "pdserve",
            "max_model_len": s.max_model_len}


@router.get("/v1/models")
async def list_models(request: Request):
    return {"object": "list", "data": [_model_card(get_state(request))]}


@router.get("/v1/models/{model:path}")
async def retrieve_model(model: str, request: Request):
    s = get_state(request)
    s.check_model(model)
    return _model_card(s)
