"""The datasheet step-time model against bench/step_cost.py, the workloads against pdserve
bench's, traces, determinism and the placement search."""
import argparse
import json

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from pdserve.bench.datasets import add_dataset_arguments, make_requests
from pdserve.bench.client import arrival_offsets
from pdserve.bench.step_cost import ModelCost, step_cost
from pdserve.config import ModelConfig
from pdserve.models import kv_spec
from pdserve.engine.cost_model import StepCostModel
from pdserve.engine.scheduler import SchedulerOutput
from pdserve.engine.sequence import Sequence
from pdserve.layers.mla import MLAShape, MultiHeadLatentAttention
from pdserve.sampling_params import SamplingParams
from pdserve.sim import search, workload
from pdserve.sim.cluster import Placement
from pdserve.sim.costs import GPUS, DatasheetStepTime, attention_keys, load_cost_model
from pdserve.sim.report import summarize
from tests.sim.helpers import requests, simulate

COST = ModelCost(num_layers=4, num_heads=8, num_kv_heads=2, head_dim=16, body_matmul_params=10**6,
                 body_other_params=10**3, lm_head_params=64 * 1000, embed_row_params=64, sliding_window=None,
                 itemsize=2)


@pytest.mark.parametrize("window", [None, 5, 40])
def test_attention_keys_closed_form(window):
    for q, c in ((1, 1), (1, 30), (7, 7), (7, 30), (30, 30), (3, 100)):
        assert attention_keys(q, c, window) == sum(min(p + 1, window or c) for p in range(c - q, c))


MLA = MLAShape(num_heads=8, q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8,
               v_head_dim=16)


@pytest.mark.parametrize("window, mla", [(None, None), (24, None), (None, MLA)])
def test_datasheet_step_is_step_cost_over_the_roofs(window, mla):
    import dataclasses
    cost = dataclasses.replace(COST, sliding_window=window, mla=mla, kv_values=mla.latent_dim if mla else 0)
    gpu = GPUS["h100"]
    t = DatasheetStepTime(gpu, cost, mfu=0.5, mbu=0.8, overhead_s=0.002)
    params = SamplingParams(max_tokens=4)
    out = SchedulerOutput()
    for n, computed, total in ((1, 40, 41), (1, 9, 10), (32, 0, 64), (20, 44, 64)):   # the last samples
        seq = Sequence("s", list(range(total)), params, 0.0)
        seq.num_computed_tokens = computed
        out.add(seq, n, n > 1)
    expected = step_cost(cost, [(1, 41), (1, 10), (32, 32), (20, 64)], logit_rows=3)
    want = max(expected.flops / (gpu.peak_flops * 0.5), expected.bytes / (gpu.bandwidth * 0.8)) + 0.002
    assert t(out) == pytest.approx(want, rel=1e-12)


def test_mla_counts_the_latent_cache(make_tiny):
    """DeepSeek-V3's paged cache holds kv_lora_rank + qk_rope_head_dim values a token and layer
    (32 + 16 in the tiny checkpoint), as the engine sizes its blocks, not K and V per head; the
    simulator's blocks and K/V transfers follow."""
    cfg = ModelConfig.from_dir(make_tiny("deepseek_v3"))
    m = ModelCost.from_config(cfg, itemsize=2)
    assert m.mla is not None and m.kv_bytes_per_token == cfg.num_layers * (32 + 16) * 2
    assert m.kv_bytes_per_token == kv_spec(cfg).bytes_per_token(cfg.num_layers, torch.bfloat16)
    assert m.kv_bytes_per_token < 2 * cfg.num_layers * cfg.num_heads * (16 + 16) * 2   # what full K/V would be
    # a decode step reads each sequence's latent rows once
    assert step_cost(m, [(1, 100)], 1).bytes_kv_read == 100 * m.kv_bytes_per_token


@pytest.mark.parametrize("q", [1, 7])
def test_mla_attention_flops_are_the_layers(q):
    """attention_flops against torch's FLOP count of layers/mla.py itself: the absorbed decode
    (q = 1) and the expanded prefill (every key's K/V made from its latent), all q x keys pairs
    (the count takes no mask into account)."""
    layer = MultiHeadLatentAttention(64, MLA, scale=0.1)
    keys = 40
    latents = torch.randn(2, keys, MLA.latent_dim)
    qn, qp = torch.randn(2, q, 8, 16), torch.randn(2, q, 8, 8)
    mask = torch.ones(2, 1, q, keys, dtype=torch.bool)
    with FlopCounterMode(display=False) as counted:
        if q == 1:
            layer._absorbed(qn, qp, latents, layer.kv_b_proj.weight.view(8, 32, 32), mask)
        else:
            layer._expanded(qn, qp, latents, mask)
    m = ModelCost(1, 8, 1, 0, 0, 0, 0, 0, None, 4, mla=MLA, kv_values=MLA.latent_dim)
    assert 2 * m.attention_flops(q, q * keys, keys) == counted.get_total_flops()   # 2 sequences


def test_load_cost_model_files(tmp_path):
    model = StepCostModel((0.01, 2e-5, 0.0, 1e-9))
    for name, body in (("roofline.json", {"model": "m", "cost_model": model.as_dict()}), ("bare.json", model.as_dict())):
        (tmp_path / name).write_text(json.dumps(body))
        assert load_cost_model(str(tmp_path / name)).coef == pytest.approx(model.coef)
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="bad.json"):
        load_cost_model(str(tmp_path / "bad.json"))


def dataset_args(*argv):
    p = argparse.ArgumentParser()
    add_dataset_arguments(p)
    p.add_argument("--request-rate", type=float, default=float("inf"))
    p.add_argument("--burstiness", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(list(argv))


def test_bench_workload_is_what_bench_sends():
    args = dataset_args("--dataset-name", "long-short", "--num-prompts", "20", "--request-rate", "3", "--seed", "5",
                        "--random-range-ratio", "0.5")
    sim = workload.bench_workload(args, vocab_size=500)
    bench = make_requests(args, 20, 5, list(range(500)))   # what bench builds with --vocab-size 500
    assert [r.prompt for r in sim] == [b.prompt for b in bench]
    assert [r.output_len for r in sim] == [b.output_len for b in bench]
    assert [r.kind for r in sim] == [b.kind for b in bench]
    assert [r.arrival for r in sim] == arrival_offsets(20, 3.0, 1.0, [5, 2])
    with pytest.raises(ValueError, match="--trace"):
        workload.bench_workload(dataset_args("--dataset-name", "multi-turn"), 500)


def test_traces(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text('{"arrival": 1.5, "prompt_len": 4, "output_len": 2}\n\n{"arrival": 1.0, "prompt_len": 3, '
                    '"output_len": 5, "priority": 1, "ttft_ms": 100}\n')
    reqs = workload.load_trace(str(path), 50)
    assert [(r.arrival, len(r.prompt), r.output_len) for r in reqs] == [(0.0, 3, 5), (0.5, 4, 2)]
    assert reqs[0].priority == 1 and reqs[0].ttft_ms == 100
    bench = {"input_lens": [10, 20, 30], "output_lens": [4, 0, 6], "start_times": [0.0, 0.1, 0.3]}
    (tmp_path / "b.json").write_text(json.dumps(bench))
    reqs = workload.load_trace(str(tmp_path / "b.json"), 50)
    assert [(r.arrival, len(r.prompt), r.output_len) for r in reqs] == [(0.0, 10, 4), (0.3, 30, 6)]   # a failure left out
    for bad, match in (('{"arrival": -1, "prompt_len": 3, "output_len": 1}', "arrival"),
                       ('{"arrival": 0, "prompt_len": 0, "output_len": 1}', "prompt_len"),
                       ('{"arrival": 0, "prompt_len": 2, "output_len": 1.5}', "output_len"),
                       ('{"arrival": 0, "prompt_len": 2, "output_len": 1, "priority": "high"}', "priority"),
                       ("[1]", "object"), ("{", "not JSON")):
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=match):
            workload.load_trace(str(path), 50)


def test_same_seed_same_prediction():
    args = dataset_args("--num-prompts", "30", "--request-rate", "20", "--random-input-len", "64",
                        "--random-output-len", "16", "--random-range-ratio", "0.5")
    runs = []
    for seed in (1, 1, 2):
        args.seed = seed
        reqs = workload.bench_workload(args, 1000)
        res = simulate(reqs, Placement(prefill=1, decode=2), router="least-loaded")[1]
        runs.append([(r.start_time, r.ttft, r.latency, tuple(r.itl)) for r in res.results])
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_search_picks_disaggregation_for_a_tpot_target():
    """Prompts of 400 (a 410 ms prefill) and 21 tokens out, step 10 ms + 1 ms a token: on
    colocated replicas a prefill stalls its neighbours' decodes, so a 15 ms TPOT target is met
    only at low rates, and 1P1D serves more; with a tight TTFT target and no TPOT one the second
    prefill engine of 2 colocated replicas serves more."""
    reqs = requests(*[(0.0, 400, 21)] * 40)

    def run_at(slos):
        return lambda p, rate: summarize(simulate(workload.rescale(reqs, rate, 1.0, 0), p)[1], slos)

    rows = search.search(2, run_at({"ttft": 10000, "tpot": 15}), 0.9, 0.5)
    assert [r["placement"] for r in rows][0] == "1P1D"
    rows = search.search(2, run_at({"ttft": 600}), 0.9, 0.5)
    assert rows[0]["placement"] == "2x colocated"
    assert rows[0]["goodput_per_machine"] == pytest.approx(rows[0]["max_rate"] / 2)


def test_placements():
    assert [p.label for p in search.placements(3)] == ["3x colocated", "1P2D", "2P1D"]
    assert len(search.placements(64)) == 16 and all(p.machines == 64 for p in search.placements(64))
    # beyond 8 machines with a hint: colocated and the three sixteenths nearest the share
    assert [p.label for p in search.placements(32, 0.3)] == ["32x colocated", "8P24D", "10P22D", "12P20D"]
    with pytest.raises(ValueError):
        Placement(prefill=1)
