#!/bin/bash
# usage: OLD=<checkout of the old commit> ab.sh PAIRS ROUNDS BATCH OUTFILE
# The old code ($OLD) and this checkout in alternating processes, ROUNDS rounds each. The order
# alternates from pair to pair: the second process of a pair tends to run faster (README.md).
cd "$(git rev-parse --show-toplevel)"
for i in $(seq "$1"); do
  order="old new"; [ $((i % 2)) = 0 ] && order="new old"
  for v in $order; do P=$PWD; [ $v = old ] && P=$OLD
    PYTHONPATH=$P python benchmarks/results/perf/engine_step_cold/overhead_rounds.py "$3" "$2" 2>/dev/null | sed "s/^/$v $i /" >> "$4"
  done
done
