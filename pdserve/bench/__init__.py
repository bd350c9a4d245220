"""Benchmarks. `pdserve bench` is serve_bench.py (a load generator with vLLM's metric
definitions), with its prompts in datasets.py and its arithmetic in bench_metrics.py;
`pdserve report` (report.py) plots its results and the server's step log."""
