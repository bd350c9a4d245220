"""benchmarks/device_check.py, issue 43's GPU check, as its --dry-run runs it on the CPU: the same
phases and code at tiny sizes. Its JSON has every phase, the environment and the targets; the
exactness phase really compared pdserve's tokens with transformers' (recomputed here, independently);
bad arguments get one line; a phase that overruns its limit is stopped and recorded."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import device_check, device_exactness
from pdserve.tokenizer import Tokenizer
from tests.helpers import hf_greedy
from tools.make_model import corpus_prompts

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCHS = ("llama",)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """One dry run through the command line, as the device runs it (phases in processes of their own)."""
    out, work = tmp_path_factory.mktemp("out"), tmp_path_factory.mktemp("work")
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--out", str(out), "--dry-run",
                           "--work-dir", str(work), "--archs", ",".join(ARCHS)],
                          cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out / "device_check.json") as f:
        return dict(json=json.load(f), out=out, work=work, stdout=proc.stdout)


def test_json_has_every_phase_the_environment_and_the_targets(dry_run):
    res, out = dry_run["json"], dry_run["out"]
    assert res["dry_run"] is True and res["device"] == "cpu"
    env = res["environment"]
    for key in ("date", "python", "torch", "cuda", "triton", "transformers", "cpu", "device"):
        assert key in env, key
    assert env["torch"] == torch.__version__
    assert list(res["phases"]) == list(device_check.PHASES)
    for name, rec in res["phases"].items():
        assert rec["status"] == "ok", (name, rec.get("log_tail"))
        assert rec["seconds"] > 0 and rec["limit_s"] > 0
    assert set(res["targets"]) == set(device_check.TARGETS)
    for t in res["targets"].values():
        assert t["status"] in ("met", "short", "not measured") and t["threshold"] > 0
    # what comes back from the device: three files, within its limit of eight
    assert sorted(os.listdir(out)) == ["device_check.json", "device_check.log", "device_check.txt"]
    text = (out / "device_check.txt").read_text()
    assert "DRY RUN" in text and "targets:" in text and text in dry_run["stdout"]


def test_exactness_really_compared_tokens_with_transformers(dry_run):
    ex = dry_run["json"]["phases"]["exactness"]
    assert list(ex["variants"]) == list(ARCHS)
    for name, v in ex["variants"].items():
        fp32 = v["fp32_tokens"]
        assert v["status"] == "ok" and fp32["equal"] is True and fp32["chunked_prefill"] is True
        assert len(fp32["ours"]) == len(fp32["reference"]) == len(device_exactness.PROMPT_LENS)
        assert fp32["tokens_compared"] == sum(map(len, fp32["reference"])) > len(fp32["reference"])
        # transformers' greedy tokens again, here, independently of the phase: the recorded reference is
        # transformers', and pdserve's tokens equal it
        path = os.path.join(dry_run["work"], f"tiny-{name}")
        prompts = corpus_prompts(Tokenizer.from_dir(path), device_exactness.PROMPT_LENS)
        for prompt, ours, ref in zip(prompts, fp32["ours"], fp32["reference"]):
            assert hf_greedy(path, prompt, len(ref)) == ref == ours
        bf16 = v["bf16_logprobs"]
        # every prompt token after the first and every generated one, of the prompts longer than one token
        lens = [n for n in device_exactness.PROMPT_LENS if n > 1]
        assert bf16["positions"] == sum(n - 1 + device_exactness.NEW_TOKENS for n in lens)
        assert bf16["within_tolerance"] is True and bf16["reference_bf16_vs_fp32"]["mean"] > 0
    # a dry run of two variants leaves most of the registry unchecked: the target says so
    assert "LlamaForCausalLM" not in ex["registry_not_covered"] and "Qwen3ForCausalLM" in ex["registry_not_covered"]
    target = dry_run["json"]["targets"]["exact_every_arch"]
    assert target["status"] == "not measured" and "Qwen3ForCausalLM" in target["reason"]


def test_a_reference_that_differs_fails_the_check(dry_run, monkeypatch):
    """The phase's comparisons use transformers' answers: shift its tokens, or its logprobs, and the
    variant fails (a comparison of pdserve with itself would still pass)."""
    path = os.path.join(dry_run["work"], "tiny-llama")
    greedy, logprobs = device_exactness.reference_greedy, device_exactness.reference_logprobs
    monkeypatch.setattr(device_exactness, "reference_greedy",
                        lambda model, prompt, n: [t + 1 for t in greedy(model, prompt, n)])
    fp32 = device_exactness.fp32_tokens(path, "cpu")
    assert fp32["equal"] is False and fp32["first_difference"]["position"] == 0
    assert all(r == [t + 1 for t in o] for o, r in zip(fp32["ours"], fp32["reference"]))
    dtypes = []

    def shifted(model, ids):   # transformers' logprobs (bf16 and fp32 alike) moved by 2 nats
        dtypes.append(model.dtype)
        return logprobs(model, ids) - 2.0
    monkeypatch.setattr(device_exactness, "reference_logprobs", shifted)
    bf16 = device_exactness.bf16_logprobs(path, "cpu")
    assert set(dtypes) == {torch.bfloat16, torch.float32}
    assert bf16["within_tolerance"] is False and bf16["mean"] == pytest.approx(2.0, abs=0.05)


def test_roofline_and_serving_figures_come_from_their_measurements(dry_run):
    ph = dry_run["json"]["phases"]
    rl = ph["roofline"]
    d, p = rl["decode"], rl["prefill"]
    assert rl["copy"]["bandwidth"] == pytest.approx(rl["copy"]["bytes_moved"] / rl["copy"]["seconds"])
    assert d["bandwidth_fraction"] == pytest.approx(d["bytes"] / rl["copy"]["bandwidth"] / (d["forward_ms"] / 1e3))
    assert p["peak_fraction"] == pytest.approx(p["flops"] / (p["forward_ms"] / 1e3) / rl["gemm"]["flops"])
    assert d["weight_bytes"] <= d["bytes"] and p["tokens"] == device_check_sizes()["prefill"]
    assert ph["make_8b"]["reused"] is False and ph["make_8b"]["bytes"] > 0
    sv = ph["serving"]
    wl = sv["workload"]["name"]
    tok_s = {s: r[wl]["metrics"]["output_throughput"] for s, r in sv["systems"].items()}
    assert set(tok_s) == {"pdserve", "static"} and all(r[wl]["status"] == "ok" for r in sv["systems"].values())
    assert sv["ratio"] == pytest.approx(tok_s["pdserve"] / tok_s["static"])
    targets = dry_run["json"]["targets"]
    assert targets["c64_vs_static"]["figure"] == sv["ratio"]
    assert targets["decode_bandwidth_fraction"]["figure"] == d["bandwidth_fraction"]


def device_check_sizes():
    from benchmarks.device_roofline import SIZES
    return SIZES[True]


def test_compare_tokens_names_the_first_difference():
    same = device_exactness.compare_tokens([[1, 2, 3], [4]], [[1, 2, 3], [4]])
    assert same == dict(tokens_compared=4, equal=True, first_difference=None)
    diff = device_exactness.compare_tokens([[1, 2, 3], [4, 5]], [[1, 2, 3], [4, 6]])
    assert not diff["equal"] and diff["first_difference"] == dict(prompt=1, position=1, ours=5, reference=6)
    short = device_exactness.compare_tokens([[1, 2]], [[1, 2, 3]])   # one side stopped early
    assert not short["equal"] and short["first_difference"] == dict(prompt=0, position=2, ours=None, reference=3)
    assert device_exactness.compare_tokens([[]], [[]])["equal"] is False   # nothing compared is no pass
    with pytest.raises(ValueError):
        device_exactness.compare_tokens([[1]], [[1], [2]])


def test_logprob_tolerance_is_relative_to_bf16s_own_error():
    gaps = device_exactness.logprob_gaps([0.0, -1.0, -2.5], [0.1, -1.0, -2.0])
    assert gaps["positions"] == 3 and gaps["max"] == pytest.approx(0.5) and gaps["argmax"] == 2
    noisy = dict(positions=3, mean=0.5, max=2.0)
    quiet = dict(positions=3, mean=0.01, max=0.1)
    assert device_exactness.within_tolerance(gaps, noisy)
    assert not device_exactness.within_tolerance(gaps, quiet)   # mean 0.2: past the floor of 0.05
    assert not device_exactness.within_tolerance(dict(gaps, max=4.5), noisy)
    assert not device_exactness.within_tolerance(dict(gaps, positions=2), noisy)   # other positions
    assert not device_exactness.within_tolerance(device_exactness.logprob_gaps([], []), noisy)


def test_targets_met_short_or_not_measured():
    phases = {"roofline": {"decode": {"bandwidth_fraction": 0.8}, "prefill": {"peak_fraction": 0.5}},
              "serving": {"ratio": None},
              "exactness": {"variants": {"a": {"status": "ok", "fp32_tokens": {"equal": True},
                                               "bf16_logprobs": {"within_tolerance": True}},
                                         "b": {"status": "failed", "fp32_tokens": {"equal": False},
                                               "bf16_logprobs": {"within_tolerance": True}}},
                            "registry_not_covered": []}}
    t = device_check.evaluate_targets(phases)
    assert t["decode_bandwidth_fraction"]["status"] == "met" and t["prefill_peak_fraction"]["status"] == "short"
    assert t["c64_vs_static"]["status"] == "not measured"
    assert (t["exact_every_arch"]["status"], t["exact_every_arch"]["figure"]) == ("short", 0.5)
    assert t["bf16_logprobs_every_arch"]["status"] == "met"
    phases["exactness"]["variants"]["b"]["status"] = "skipped: out of time"
    assert device_check.evaluate_targets(phases)["exact_every_arch"]["status"] == "not measured"


def test_phase_limits_share_the_budget():
    order = list(device_check.PHASES)
    import time
    now = time.monotonic()
    # at the start each phase may use its own share, and the first also the slack beyond all shares
    slack = 500 - sum(device_check.PHASES.values())
    assert device_check.phase_limit("exactness", order, now, 500) == pytest.approx(
        device_check.PHASES["exactness"] + slack, abs=1)
    # late, a phase gets what is left, never more
    assert device_check.phase_limit("serving", order, now - 480, 500) == pytest.approx(20, abs=1)


def test_a_phase_past_its_limit_is_stopped_and_recorded(tmp_path):
    args = device_check.parse_args(["--out", str(tmp_path), "--dry-run", "--work-dir", str(tmp_path)])
    with open(tmp_path / "log", "w") as log:
        rec = device_check.spawn_phase("exactness", args, 0.5, log)   # still importing at 0.5 s
    assert rec["status"].startswith("stopped at its limit") and rec["limit_s"] == 0


def test_roofline_without_a_checkpoint_is_skipped_and_the_json_written(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "benchmarks.device_check", "--out", str(tmp_path / "o"), "--dry-run",
                           "--work-dir", str(tmp_path / "w"), "--phases", "roofline,serving"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    res = json.loads((tmp_path / "o" / "device_check.json").read_text())
    for name in ("roofline", "serving"):
        assert res["phases"][name] == dict(status="skipped", reason="no 8B-shaped checkpoint (make_8b did not finish)")
    assert all(t["status"] == "not measured" for t in res["targets"].values())


@pytest.mark.parametrize("argv, message", [
    (["--device", "tpu", "--dry-run"], "--device 'tpu'"),
    (["--device", "cpu"], "add --dry-run"),
    (["--dry-run", "--archs", "llama,nosuch"], "unknown variant 'nosuch'"),
    (["--dry-run", "--phases", "exactness,nosuch"], "--phases"),
    (["--dry-run", "--budget-s", "5"], "--budget-s 5"),
])
def test_bad_arguments_get_one_line(tmp_path, capsys, argv, message):
    with pytest.raises(SystemExit) as e:
        device_check.main(["--out", str(tmp_path), *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) <= 2   # the line, and the pointer to --help


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where there is no GPU")
def test_no_gpu_is_one_line(tmp_path, capsys):
    assert device_check.main(["--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == "device_check: error: no CUDA device here (on a CPU, run with --dry-run)"
    res = json.loads((tmp_path / "device_check.json").read_text())   # written all the same
    assert res["error"] == "no CUDA device here" and res["environment"]["device"] == "cuda"
