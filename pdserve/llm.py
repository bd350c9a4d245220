"""The offline API: `LLM(path).generate(prompts, SamplingParams(...))`."""
import dataclasses
import logging
from collections.abc import Iterator

from pdserve.engine.llm_engine import LLMEngine
from pdserve.engine.outputs import RequestOutput
from pdserve.sampling_params import SamplingParams

Prompt = str | list[int]


class LLM:
    """Build it on the thread that calls it: each thread that runs OpenMP regions gets its own worker
    pool, and more pool threads than cores make libgomp sleep between regions (server/async_engine.py:
    EngineThread)."""

    def __init__(self, model: str, **engine_kwargs):
        self.engine = LLMEngine(model, **engine_kwargs)
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0
        self.generation = self.engine.config.generation_defaults()
        if self.generation.source is not None:
            logging.getLogger("pdserve").info("generation defaults: %s", self.generation.describe())

    def get_default_sampling_params(self) -> SamplingParams:
        """What generate() uses when given no SamplingParams (vLLM's LLM.get_default_sampling_params):
        SamplingParams' defaults under generation_config.json's (--generation-config)."""
        max_tokens = {"max_tokens": self.generation.max_tokens} if self.generation.max_tokens else {}
        return SamplingParams(**self.generation.sampling_kwargs({}), **max_tokens)

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = False) -> list[RequestOutput]:
        """Run all prompts together (continuous batching) and return their final outputs in input order."""
        final: dict[str, RequestOutput] = {}
        ids = self._add(prompts, params, final_only=True)   # no per-step outputs: only the finals are read
        bar = None
        if use_tqdm:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="generating", unit="req")
        for out in self._run():
            if out.finished:
                final[out.request_id] = out
                if bar:
                    bar.update(1)
        if bar:
            bar.close()
        return [final[i] for i in ids]

    def generate_stream(self, prompts: Prompt | list[Prompt],
                        params: SamplingParams | list[SamplingParams] | None = None) -> Iterator[RequestOutput]:
        """Yield each request's output as every step produces it (`new_text` is the delta)."""
        self._add(prompts, params)
        yield from self._run()

    def _add(self, prompts, params, final_only: bool = False) -> list[str]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = params or self.get_default_sampling_params()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        if final_only:   # copies: the caller's params stay as they were
            copies = {id(p): dataclasses.replace(p, final_only=True) for p in plist}
            plist = [copies[id(p)] for p in plist]
        ids = []
        try:
            for prompt, p in zip(prompts, plist):
                rid = str(self._next_id)
                self._next_id += 1
                self.engine.add_request(rid, prompt, p)
                ids.append(rid)
        except Exception:
            for rid in ids:   # all or nothing: do not leave half a batch in the engine
                self.engine.abort_request(rid)
            self.engine.step()
            raise
        return ids

    def _run(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished_requests():
            yield from self.engine.step()
