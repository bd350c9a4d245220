"""The step-time model fitted on synthetic steps with known costs."""
import numpy as np
import pytest

from pdserve.engine.cost_model import REFIT_EVERY, StepCostModel, calibrate, calibration_shapes, step_features

TRUE = np.array([0.004, 2e-5, 3e-5, 4e-9])   # 4 ms + 20 us/token + 30 us/seq + 4 ns/pair


def synthetic_steps(rng, n: int):
    for _ in range(n):
        b = int(rng.integers(1, 33))
        tokens = [1] * b
        contexts = rng.integers(0, 1024, size=b).tolist()
        if rng.random() < 0.5:
            chunk = int(rng.integers(2, 512))
            tokens.append(chunk)
            contexts.append(int(rng.integers(0, 512)))
        yield step_features(tokens, contexts)


def prediction_ratios(model: StepCostModel, rng, scale: float) -> float:
    """Median of predicted / (scale x true) step time over fresh synthetic steps."""
    xs = list(synthetic_steps(rng, 200))
    return float(np.median([model.predict(*x[1:]) / (scale * np.dot(TRUE, x)) for x in xs]))


def test_step_features():
    # two decodes at contexts 10 and 20, a chunk of 5 after 3 cached tokens
    assert step_features([1, 1, 5], [10, 20, 3]) == (1.0, 7.0, 3.0, 11 + 21 + 5 * 8)


def test_fit_recovers_known_coefficients():
    rng = np.random.default_rng(0)
    model = StepCostModel()
    for x in synthetic_steps(rng, 300):
        y = float(np.dot(TRUE, x)) * (1 + 0.02 * rng.standard_normal())
        model.observe(x, y)
    model.fit()
    # the per-step, per-token and per-sequence costs come back; the attention term is small in
    # these steps (under a tenth of the time), so it is judged by the predictions it makes
    assert model.coef[:3] == pytest.approx(TRUE[:3], rel=0.1)
    assert (model.coef >= 0).all()
    assert prediction_ratios(model, rng, 1.0) == pytest.approx(1.0, abs=0.03)


def test_coefficients_stay_non_negative():
    model = StepCostModel()
    # step time falls with tokens in this (nonsense) data: the token coefficient is clipped to 0
    for tokens in range(1, 50):
        model.add_calibration((1.0, float(tokens), 1.0, 0.0), 0.1 - 0.001 * tokens)
    coef = model.fit()
    assert (coef >= 0).all() and coef[1] == 0.0


def test_measured_steps_refresh_the_calibration():
    rng = np.random.default_rng(1)
    model = StepCostModel()
    for x in synthetic_steps(rng, 40):
        model.add_calibration(x, float(np.dot(TRUE, x)))
    model.fit()
    before = model.coef.copy()
    assert before == pytest.approx(TRUE, rel=0.01)
    # the machine gets twice as slow (another tenant): the live steps pull the model along
    for x in synthetic_steps(rng, 20 * REFIT_EVERY):
        model.observe(x, 2 * float(np.dot(TRUE, x)))
    assert model.num_observed == 20 * REFIT_EVERY
    # the start-up points, faded, still pull a little: predictions land near twice as slow
    assert prediction_ratios(model, rng, 2.0) == pytest.approx(1.0, abs=0.05)


def test_max_prefill_tokens_and_prefill_time():
    model = StepCostModel((0.010, 0.001, 0.0, 0.0))
    # 4 decodes: 10 + (4 + n) ms <= 30 ms -> 16
    assert model.max_prefill_tokens(0.030, 4, 400, limit=512) == 16
    assert model.max_prefill_tokens(0.012, 4, 400, limit=512) == 0    # the decodes alone take 14 ms
    assert model.max_prefill_tokens(10.0, 4, 400, limit=100) == 100   # bounded by the budget
    # 100 tokens at 16 a step beside 4 decodes: 7 steps of 10 + 20 ms
    assert model.prefill_time(100, 16, 4, 400) == pytest.approx(7 * 0.030)
    assert model.prefill_time(0, 16, 4, 400) == 0.0


def test_calibrate_times_each_shape_and_fits():
    shapes = calibration_shapes(512, 32, 2048)
    seen = []
    model = StepCostModel()
    calibrate(model, lambda n, c: seen.append((n, c)), shapes, repeats=2)
    assert seen == [s for s in shapes for _ in range(3)]   # a warm-up and two timed runs each
    assert model.num_calibration == 2 * len(shapes)
    # every shape fits the context and the budget
    for n, c in shapes:
        assert sum(n) <= 512 and all(a + b <= 2048 for a, b in zip(n, c))


def test_engine_calibrates_at_start_and_learns_from_every_step(tiny_llama):
    from pdserve.engine.llm_engine import LLMEngine
    from pdserve.sampling_params import SamplingParams

    engine = LLMEngine(tiny_llama, scheduling_policy="slo", max_num_batched_tokens=64, max_num_seqs=4)
    cm = engine.cost_model
    assert cm.num_calibration == len(calibration_shapes(64, 4, engine.max_model_len))
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks   # calibration gave its blocks back
    for i in range(3):
        engine.add_request(str(i), list(range(1, 20 + 30 * i)), SamplingParams(max_tokens=5, temperature=0))
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert cm.num_observed == steps
    assert LLMEngine(tiny_llama).cost_model is None   # fcfs: nothing calibrated, nothing observed


def test_as_dict_round_trips_and_bad_dicts_are_refused():
    model = StepCostModel(tuple(TRUE))
    model.num_calibration = 5
    back = StepCostModel.from_dict(model.as_dict())
    assert back.coef == pytest.approx(TRUE) and back.num_calibration == 5
    assert back.predict(100, 3, 5000) == pytest.approx(model.predict(100, 3, 5000))
    with pytest.raises(ValueError, match="tokens_s"):
        StepCostModel.from_dict({"intercept_s": 0.01})
    with pytest.raises(ValueError, match=">= 0"):
        StepCostModel.from_dict({**model.as_dict(), "seqs_s": -1.0})
