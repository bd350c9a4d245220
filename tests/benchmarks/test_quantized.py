"""benchmarks/quantized.py's report: each pdserve format against its full precision, each peer against
pdserve on the same file, the AVX2 row apart from the best build's."""
from benchmarks import quantized


def rec(system, weights, tok_s, isa="", **kw):
    return dict(model="qwen2-0.5b", system=system, weights=weights, isa=isa, status="ok",
                variant=quantized.Variant(system, weights, isa).name,
                c32={"metrics": {"output_throughput": tok_s, "mean_tpot_ms": 100.0}},
                c1={"metrics": {"mean_tpot_ms": 40.0}}, **kw)


def cells(line):
    return [c.strip() for c in line.split("|")[1:-1]]


def test_ratios_against_full_precision_and_the_peers():
    recs = [rec("llama-server", "Q4_K_M", 50.0), rec("pdserve", "Q4_K_M", 150.0),
            rec("pdserve", "fp32", 100.0), rec("pdserve", "W4A16", 120.0, isa="avx2"),
            rec("pdserve", "W4A16", 130.0, read_line=dict(status="ok", ratio_median=1.1, step_ms=22.0, read_ms=20.0)),
            rec("vllm", "W4A16", 65.0),
            dict(model="qwen2-0.5b", system="vllm", weights="fp32", isa="", variant="vllm-fp32", status="start failed",
                 error="Traceback\nValueError: no kernel\n")]
    rows = [cells(ln) for ln in quantized.table(recs).splitlines()[2:]]
    order = [(r[1].split(" ")[0], r[2]) for r in rows]
    assert order == [("pdserve", "fp32"), ("pdserve", "Q4_K_M"), ("pdserve", "W4A16"),
                     ("pdserve", "W4A16, PDSERVE_CPU_ISA=avx2"), ("llama-server", "Q4_K_M"), ("vllm", "fp32"),
                     ("vllm", "W4A16")]
    by = {o: r for o, r in zip(order, rows)}
    assert by[("pdserve", "Q4_K_M")][6] == "1.50x" and by[("pdserve", "fp32")][6] == "1.00x"
    assert by[("pdserve", "W4A16, PDSERVE_CPU_ISA=avx2")][6] == "1.20x"
    assert by[("llama-server", "Q4_K_M")][7] == "3.00x"       # pdserve on the same file / llama-server
    assert by[("vllm", "W4A16")][7] == "2.00x"                 # against the best build, not the AVX2 one
    assert by[("pdserve", "W4A16")][8] == "1.10x (22.0 / 20.0 ms)"
    assert "start failed: ValueError: no kernel" in by[("vllm", "fp32")][1]
