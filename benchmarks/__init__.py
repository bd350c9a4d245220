"""Side-by-side measurements run by maintainers: `python -m benchmarks.compare` (every backend and
the real peers), `benchmarks.budget_sweep`, `benchmarks.soak`, `benchmarks.fuzz`,
`benchmarks.overload`, `benchmarks.quant_accuracy`. Raw results go to benchmarks/results/
(git-ignored); docs/BENCHMARKS.md and the files it links live under docs/."""
