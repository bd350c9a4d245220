"""benchmarks/slo_sweep.py: the answer it reads off the sweep, and the commands it would run."""
from benchmarks import slo_sweep


def row(policy, rate, attainment, goodput=1.0):
    return {"policy": policy, "rate": rate, "slo_attainment": attainment, "slo_ttft_attainment": attainment,
            "slo_tpot_attainment": attainment, "short_slo_attainment": attainment, "long_slo_attainment": 1.0,
            "slo_goodput": goodput, "request_throughput": rate, "failed": 0}


def test_max_rate_at_takes_the_highest_rate_that_reaches_the_target():
    rows = [row("slo", 1, 1.0), row("slo", 2, 0.95), row("slo", 4, 0.85), row("slo", 8, 0.92)]
    # the highest swept rate at the target, even past a dip (noise at one rate is the reader's call)
    assert slo_sweep.max_rate_at(rows, 0.9)["rate"] == 8
    assert slo_sweep.max_rate_at(rows, 0.99)["rate"] == 1
    assert slo_sweep.max_rate_at([row("fcfs", 1, 0.5)], 0.9) is None


def test_table_names_each_policys_answer():
    text = slo_sweep.table([row("fcfs", 1, 0.95, 0.9), row("fcfs", 2, 0.6), row("slo", 1, 0.5)], 0.9)
    assert "fcfs: highest rate with >= 90% attainment: 1 req/s (goodput 0.90 req/s)" in text
    assert "slo: no swept rate reaches the target" in text


def test_dry_run_prints_one_server_and_a_bench_per_rate(capsys, tmp_path):
    assert slo_sweep.main(["--dry-run", "--policies", "fcfs,slo", "--rates", "4,1", "--results", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    servers = [line for line in lines if " serve " in line]
    benches = [line for line in lines if " bench " in line]
    assert len(servers) == 2 and "--scheduling-policy slo" in servers[1]
    assert len(benches) == 4 and "--request-rate 1.0" in benches[0] and "--request-rate 4.0" in benches[1]
    assert "--slo-mix short:1000:60:0 long:20000:400:1" in benches[0]


def test_vllm_gets_the_same_targets_without_priorities(capsys, tmp_path):
    assert slo_sweep.main(["--dry-run", "--policies", "vllm", "--rates", "1", "--results", str(tmp_path),
                           "--peers-dir", str(tmp_path / "peers")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any("vllm" in line and " serve " in line for line in lines)
    bench = next(line for line in lines if " bench " in line)
    assert "--slo-mix short:1000:60 long:20000:400 " in bench   # its fcfs scheduler refuses priority != 0


def test_each_rate_sends_new_prompts_and_each_system_the_same_ones(capsys, tmp_path):
    assert slo_sweep.main(["--dry-run", "--policies", "fcfs,slo", "--rates", "1,2,4", "--results", str(tmp_path)]) == 0
    benches = [line for line in capsys.readouterr().out.splitlines() if " bench " in line]
    seeds = [line.split("--seed ")[1].split()[0] for line in benches]
    assert len(set(seeds[:3])) == 3 and seeds[:3] == seeds[3:]   # a cached prompt would be a free hit
