"""benchmarks/spec_compare.py: each system's speculation flags, one set of prompts for all, the table."""
import json

from benchmarks import spec_compare


def test_dry_run_turns_each_systems_ngram_mode_on_with_the_same_prompts(capsys, tmp_path):
    assert spec_compare.main(["--dry-run", "--systems", "engine,engine-ngram", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    serves = [line for line in lines if " serve " in line]
    benches = [line for line in lines if " bench " in line]
    assert len(serves) == 2 and "--speculative-config" not in serves[0]
    config = json.loads(serves[1].split("--speculative-config ")[1])
    assert config == {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    assert len(benches) == 6 and all("--save-detailed" in b for b in benches)
    seeds = [b.split("--seed ")[1].split()[0] for b in benches]
    assert seeds[:3] == seeds[3:] and len(set(seeds[:3])) == 3   # per workload, not per system
    assert "--dataset-name edit" in benches[0] and "--max-concurrency 1" in benches[0]


def test_peers_get_their_own_ngram_flags():
    assert spec_compare.spec_flags("llama-server") == []
    llama = spec_compare.spec_flags("llama-server-ngram")
    assert llama[:2] == ["--spec-type", "ngram-simple"] and llama[llama.index("--spec-ngram-simple-size-m") + 1] == "4"
    assert json.loads(spec_compare.spec_flags("vllm-ngram")[1])["method"] == "ngram"


def test_table_reads_each_mode_against_its_plain_run_and_checks_the_tokens():
    rows = [{"system": "engine", "workload": "edit-c1", "median_tpot_ms": 80.0, "output_throughput": 12.0,
             "failed": 0, "acceptance_rate": None, "texts": ["a b", "c"]},
            {"system": "engine-ngram", "workload": "edit-c1", "median_tpot_ms": 40.0, "output_throughput": 24.0,
             "failed": 0, "acceptance_rate": 0.75, "texts": ["a b", "c"]},
            {"system": "vllm", "workload": "edit-c1", "median_tpot_ms": 90.0, "output_throughput": 11.0,
             "failed": 0, "acceptance_rate": None, "texts": ["a b", "c"]},
            {"system": "vllm-ngram", "workload": "edit-c1", "median_tpot_ms": 60.0, "output_throughput": 15.0,
             "failed": 0, "acceptance_rate": 0.5, "texts": ["a b", "d"]},
            {"system": "llama-server-ngram", "workload": "edit-c1", "error": "start failed: no binary"}]
    spec_compare.same_tokens(rows)
    assert rows[1]["tokens_equal_plain"] is True and rows[3]["tokens_equal_plain"] is False
    text = spec_compare.table(rows)
    assert "| edit-c1 | engine-ngram | 40.0 | 0.50x | 24.0 | 2.00x | 75% | yes | 0 |" in text
    assert "| edit-c1 | vllm-ngram | 60.0 | 0.67x | 15.0 | 1.36x | 50% | no | 0 |" in text
    assert "| edit-c1 | llama-server-ngram | start failed: no binary |" in text
