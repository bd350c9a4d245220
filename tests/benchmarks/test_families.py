"""benchmarks/families.py's report: rows from records, pdserve's c32 ratio to each peer, the doc block."""
from benchmarks import families


def rec(system, tok_s, model="qwen3-hub", dtype="bfloat16", **kw):
    return dict(model=model, dtype=dtype, system=system, status="ok", ready_s=10.0,
                c32={"metrics": {"output_throughput": tok_s, "mean_tpot_ms": 100.0}},
                c1={"metrics": {"mean_tpot_ms": 40.0}}, **kw)


def test_table_ratios_within_the_same_checkpoint_and_dtype():
    recs = [rec("vllm", 50.0), rec("pdserve", 100.0, read_line=dict(status="ok", ratio_median=1.05, step_ms=36.0,
                                                                     read_ms=34.3)),
            rec("llama-server", 25.0), rec("vllm", 10.0, dtype="float32"),
            dict(model="qwen3-hub", dtype="float32", system="llama-server", status="start failed", error="OOM\nmore")]
    lines = families.table(recs).splitlines()[2:]
    assert [ln.split("|")[3].strip() for ln in lines][:3] == ["pdserve", "vllm", "llama-server"]   # bfloat16 before float32; pdserve first
    row = {(ln.split("|")[2].strip(), ln.split("|")[3].strip().split(" ")[0]): ln for ln in lines}
    assert "| 2.00x |" in row[("bfloat16", "vllm")] and "| 4.00x |" in row[("bfloat16", "llama-server")]
    assert "1.05x (36.0 / 34.3 ms)" in row[("bfloat16", "pdserve")]
    assert "| - |" in row[("float32", "vllm")]          # no pdserve record for float32: no ratio
    assert "start failed: OOM" in row[("float32", "llama-server")]


def test_doc_block_is_replaced_not_appended(tmp_path):
    doc = tmp_path / "B.md"
    doc.write_text("# Benchmarks\n")
    families.write_doc(str(doc), "first")
    families.write_doc(str(doc), "second")
    text = doc.read_text()
    assert text.count(families.SECTIONS["families"]) == 1 and "second" in text and "first" not in text
    families.write_doc(str(doc), "moe table", "moe")   # issue 41's block: its own heading, the families' kept
    text = doc.read_text()
    assert text.count(families.SECTIONS["moe"]) == 1 and "moe table" in text and "second" in text
