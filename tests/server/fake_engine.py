"""A stand-in for LLMEngine with the same interface, for the server's unit tests only.

Characters are tokens (id = ord(c)); request i's k-th generated token is chr(ord('a') + k % 26),
so outputs are predictable. The end-to-end tests use the real engine and real checkpoints.
"""
import time

from pdserve.config import EngineConfig
from pdserve.engine.outputs import EngineStats, RequestMetrics, RequestOutput, StepStats
from pdserve.errors import RequestError


class FakeTokenizer:
    vocab_size = 128
    max_token_chars = 1   # a character is a token
    eos_token_ids = [0]

    def encode(self, text, add_special_tokens=True):
        return [ord(c) % 128 for c in text]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt=True, **template_vars):   # vars unused
        return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + ("assistant:" if add_generation_prompt else "")

    def encode_chat(self, messages, add_generation_prompt=True, **template_vars):
        return self.encode(self.apply_chat_template(messages, add_generation_prompt))


class _Req:
    def __init__(self, rid, prompt, params, arrival):
        self.rid, self.prompt, self.params = rid, prompt, params
        self.tokens, self.aborted = [], False
        self.metrics = RequestMetrics(arrival_time=arrival)


class FakeEngine:
    name = "fake"
    model_name = "fake-model"

    def __init__(self, max_model_len=64, max_num_seqs=4, block_size=4, num_blocks=64, step_time=0.002,
                 fail_at_step=None):
        self.tokenizer = FakeTokenizer()
        # the settings the server reads (no generation_config.json: "vllm" defaults)
        self.config = EngineConfig(model=self.model_name, device="cpu", max_num_seqs=max_num_seqs,
                                   block_size=block_size, generation_config="vllm")
        self.max_model_len, self.max_num_seqs = max_model_len, max_num_seqs
        self.seqs = {}   # its requests are not Sequences: the live view shows none
        self.block_size, self.num_blocks = block_size, num_blocks
        self.step_time, self.fail_at_step = step_time, fail_at_step
        self.waiting: list[_Req] = []
        self.running: list[_Req] = []
        self.last_step = None
        self.num_steps = 0
        self.all_ids: list[str] = []

    def add_request(self, request_id, prompt, params, arrival_time=None):
        if isinstance(prompt, str):
            prompt = self.tokenizer.encode(prompt)
        if not prompt:
            raise RequestError("prompt must not be empty", param="prompt")
        if len(prompt) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(prompt)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                               f"max_model_len ({self.max_model_len})", param="max_tokens")
        self.waiting.append(_Req(request_id, list(prompt), params, arrival_time or time.perf_counter()))
        self.all_ids.append(request_id)

    def abort_request(self, request_id):
        for r in self.waiting + self.running:
            if r.rid == request_id:
                r.aborted = True

    def has_unfinished_requests(self):
        return bool(self.waiting or self.running)

    def get_stats(self):
        used = sum(-(-(len(r.prompt) + len(r.tokens)) // self.block_size) for r in self.running)
        return EngineStats(num_running=len(self.running), num_waiting=len(self.waiting),
                           num_free_blocks=self.num_blocks - used, num_total_blocks=self.num_blocks)

    def _output(self, r, new, finish_reason):
        text = self.tokenizer.decode(r.tokens)
        # cumulative, like the engine's: one {token_id: logprob} per generated token so far
        lps = [{t: -0.5, (t + 1) % 128: -1.0} for t in r.tokens] if r.params.logprobs is not None else None
        return RequestOutput(request_id=r.rid, prompt_token_ids=r.prompt, token_ids=list(r.tokens), text=text,
                             new_token_ids=list(new), new_text=self.tokenizer.decode(new), logprobs=lps,
                             finished=finish_reason is not None, finish_reason=finish_reason, metrics=r.metrics)

    def step(self):
        self.num_steps += 1
        if self.fail_at_step is not None and self.num_steps >= self.fail_at_step:
            raise RuntimeError("fake engine failure")
        start = time.perf_counter()
        time.sleep(self.step_time)
        outputs = []
        for r in [r for r in self.waiting if r.aborted]:
            self.waiting.remove(r)
            outputs.append(self._output(r, [], "abort"))
        while self.waiting and len(self.running) < self.max_num_seqs:
            r = self.waiting.pop(0)
            r.metrics.first_scheduled_time = start
            r.metrics.num_prefill_steps = 1
            self.running.append(r)
        now = time.perf_counter()
        for r in list(self.running):
            if r.aborted:
                self.running.remove(r)
                r.metrics.finished_time = now
                outputs.append(self._output(r, [], "abort"))
                continue
            tok = ord("a") + len(r.tokens) % 26
            r.tokens.append(tok)
            r.metrics.token_times.append(now)
            r.metrics.first_token_time = r.metrics.first_token_time or now
            done = "length" if len(r.tokens) >= r.params.max_tokens else None
            if done:
                self.running.remove(r)
                r.metrics.finished_time = now
            outputs.append(self._output(r, [tok], done))
        n = len(self.running) + sum(o.finished for o in outputs)
        self.last_step = StepStats(start_time=start, duration=time.perf_counter() - start, num_seqs=n,
                                   num_prefill_tokens=0, num_decode_tokens=n, num_preemptions=0, forward_time=0.0)
        return outputs


class FakePagedEngine(FakeEngine):
    """A FakeEngine that is a PagedEngine (engine/interface.py): the endpoints a paged KV cache
    allows are open; prompt logprobs and grammars (it has no output processor) are still refused."""
    computes_prompt_logprobs = False
    last_schedule = None

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.resets = 0

    @property
    def kv_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def num_kv_blocks(self) -> int:
        return self.num_blocks

    num_kv_leases = 0

    def wake(self) -> None:
        pass

    def close(self) -> None:
        pass

    def reset_prefix_cache(self) -> dict:
        self.resets += 1
        return {"reset_blocks": 0, "cached_blocks_in_use": 0}

    def kv_transfer_info(self) -> dict:
        return {"role": "both", "engine_id": None, "block_size": self.block_size, "dtype": "float32",
                "transport": None, "kv_host": None, "kv_port": None}
