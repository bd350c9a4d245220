"""benchmarks/prefix_compare.py: the commands it would run and the ratios it reads off the runs."""
from benchmarks import prefix_compare


def test_dry_run_gives_each_system_its_own_seeds_and_the_cache_flag(capsys, tmp_path):
    assert prefix_compare.main(["--dry-run", "--systems", "engine,engine-nocache", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    serves = [line for line in lines if " serve " in line]
    benches = [line for line in lines if " bench " in line]
    assert len(serves) == 2 and "--no-enable-prefix-caching" in serves[1] and "--no-enable" not in serves[0]
    assert len(benches) == 4
    seeds = [line.split("--seed ")[1].split()[0] for line in benches]
    assert len(set(seeds)) == 4   # every server caches prefixes: no prompt is seen twice
    assert "--dataset-name multi-turn" in benches[0] and "--turn-passage-words 160" in benches[0]
    assert "--dataset-name shared-prefix" in benches[1] and "--prefix-len 1024" in benches[1]


def test_table_reads_pdserve_against_each_system():
    rows = [{"system": "engine", "workload": "multi-turn", "later_turns_median_ttft_ms": 100.0, "failed": 0,
             "last_turn_prompt_tokens": 1200, "prefix_cache_hit_rate": 0.8},
            {"system": "vllm", "workload": "multi-turn", "later_turns_median_ttft_ms": 400.0, "failed": 0,
             "last_turn_prompt_tokens": 1190, "prefix_cache_hit_rate": None},
            {"system": "engine", "workload": "shared-prefix", "output_throughput": 30.0, "median_ttft_ms": 900.0,
             "failed": 0, "prefix_cache_hit_rate": 0.7},
            {"system": "engine-nocache", "workload": "shared-prefix", "output_throughput": 10.0,
             "median_ttft_ms": 3000.0, "failed": 0, "prefix_cache_hit_rate": 0.0},
            {"system": "llama-server", "workload": "shared-prefix", "error": "start failed: no binary"}]
    text = prefix_compare.table(rows)
    assert "| vllm | 400 | 0.25x | 1,190 | n/a | 0 |" in text
    assert "| engine-nocache | 10.0 | 3.00x | 3,000 | 0% | 0 |" in text
    assert "| llama-server | start failed: no binary |" in text
