"""Fit pdserve's step-time model on this machine for the simulator: the engine's start-up
calibration (LLMEngine.calibrate_cost_model: timed forwards), then a short mixed workload run
through LLMEngine.step, whose measured steps (scheduling, forward, sampling and outputs, as the
server runs them) refit the model (StepCostModel.observe)."""
import json
import platform
import time

import numpy as np

from pdserve.engine.cost_model import StepCostModel
from pdserve.sampling_params import SamplingParams


def fit_here(engine_kwargs: dict, num_requests: int = 24, seed: int = 0) -> dict:
    """Fit the model for the engine these kwargs build; returns the JSON-able record
    ({"cost_model": ..., ...}) that load_cost_model reads."""
    from pdserve.engine.llm_engine import LLMEngine
    engine = LLMEngine(**engine_kwargs)
    model = engine.cost_model = StepCostModel()
    t0 = time.perf_counter()
    engine.calibrate_cost_model()
    c, rng = engine.config, np.random.default_rng(seed)
    vocab = engine.model_config.vocab_size
    longest = min(engine.max_model_len, engine.kv_capacity // max(1, min(c.max_num_seqs, num_requests)))
    # two waves: a burst of mixed prompts (chunked prefills beside decodes), then decodes at a
    # higher batch; lengths span the budget and the context the cache allows
    for wave, (count, out_len) in enumerate(((num_requests // 2, 24), (num_requests - num_requests // 2, 48))):
        for i in range(count):
            prompt_len = int(rng.integers(8, max(9, min(2 * c.max_num_batched_tokens, longest - out_len))))
            params = SamplingParams(max_tokens=out_len, temperature=0.0, ignore_eos=True, final_only=(i % 2 == 0))
            engine.add_request(f"fit-{wave}-{i}", rng.integers(0, vocab, size=prompt_len).tolist(), params)
        while engine.has_unfinished_requests():
            engine.step()
    model.fit()
    engine.block_manager.check_all_free()
    return {"model": engine_kwargs["model"], "machine": platform.processor() or platform.machine(),
            "fit_seconds": time.perf_counter() - t0, "cost_model": model.as_dict(),
            "engine": {k: getattr(c, k) for k in ("dtype", "device", "max_num_batched_tokens", "max_num_seqs",
                                                  "block_size", "threads", "cpu_kernels")},
            "describe": model.describe()}


def save(record: dict, path: str) -> None:
    with open(path, "w") as f:
        json.dump(record, f, indent=1)
