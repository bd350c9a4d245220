#!/bin/bash
# Perplexity of the bundled default model's Hub-format checkpoints (made by round-to-nearest with
# tools/quantize_hub.py) against its fp32 weights and pdserve's --quantization int8, each served by
# `pdserve serve` and scored by `pdserve perplexity` on the held-out stories of
# tools/train_default.py's split (seed 0, 2% of documents), --max-length 256 (the model's training
# window) --stride 128. The text goes in files of <= 30,000 characters (under the server's prompt
# cap); the figure is the token-weighted mean NLL over them. docs/QUANTIZATION.md has the results.
# Usage: benchmarks/hub_quantized_perplexity.sh [OUT_DIR]   (from the repository root)
set -e
PY=${PYTHON:-python}
SRC=pdserve/data/default-model
OUT=${1:-/tmp/hub-quantized-perplexity}
mkdir -p $OUT/parts
$PY - "$OUT" <<'PY'
import os, random, sys
from tools import CORPUS_DIR
out = sys.argv[1]
stories = [s.strip() for s in open(os.path.join(CORPUS_DIR, "stories.txt"), encoding="utf-8").read().split("\n\n")
           if s.strip()]
n_dialogues = sum(1 for _ in open(os.path.join(CORPUS_DIR, "dialogues.jsonl"), encoding="utf-8"))
idx = list(range(len(stories) + n_dialogues))   # train_default's documents: stories, then dialogues
random.Random(0).shuffle(idx)                    # its shuffle (seed 0); the first 2% are held out
held = [stories[i] for i in idx[:len(idx) // 50] if i < len(stories)]
parts, cur = [], []
for s in held:
    if cur and len("\n\n".join(cur + [s])) > 30000:
        parts.append(cur)
        cur = []
    cur.append(s)
parts.append(cur)
for i, p in enumerate(parts):
    open(os.path.join(out, "parts", f"{i:03d}.txt"), "w", encoding="utf-8").write("\n\n".join(p) + "\n")
print(f"{len(held)} held-out stories in {len(parts)} files")
PY
run() {  # name model-dir [serve args...]
  local name=$1 model=$2 port=$((18700 + RANDOM % 500))
  shift 2
  $PY -m pdserve serve $model --port $port "$@" > $OUT/$name.serve.log 2>&1 &
  local pid=$!
  for i in $(seq 180); do curl -sf http://127.0.0.1:$port/health > /dev/null && break; sleep 1; done
  for f in $OUT/parts/*.txt; do
    echo "$name $($PY -m pdserve perplexity --base-url http://127.0.0.1:$port --max-length 256 --stride 128 --json $f)" \
      >> $OUT/results.txt
  done
  kill $pid
  wait $pid || true
}
: > $OUT/results.txt
run fp32 $SRC
run int8-pdserve $SRC --quantization int8
for spec in "gptq-int4-g32-sym:--format gptq --bits 4 --group 32" \
            "gptq-int4-g64-asym-actorder:--format gptq --bits 4 --group 64 --asym --act-order" \
            "gptq-int8-channel-sym:--format gptq --bits 8 --group -1" \
            "awq-int4-g64:--format awq --group 64" \
            "ct-w4a16-g64-sym:--format ct --bits 4 --group 64" \
            "ct-w4a16-g32-asym:--format ct --bits 4 --group 32 --asym" \
            "ct-w8a16-channel:--format ct --bits 8 --group -1" \
            "ct-fp8-dynamic:--format ct --fp8 dynamic"; do
  name=${spec%%:*}
  rm -rf $OUT/$name $OUT/$name-dq
  $PY -m tools.quantize_hub $SRC $OUT/$name ${spec#*:} > $OUT/$name.make.log 2>&1
  run $name $OUT/$name
done
$PY - "$OUT/results.txt" <<'PY'
import json, math, sys
agg = {}
for line in open(sys.argv[1]):
    name, _, js = line.strip().partition(" ")
    r = json.loads(js)
    t, n = agg.get(name, (0, 0.0))
    agg[name] = (t + r["tokens"], n + r["tokens"] * r["mean_nll"])
base = math.exp(agg["fp32"][1] / agg["fp32"][0])
print("| checkpoint | tokens | mean NLL | perplexity | vs fp32 |\n|---|---|---|---|---|")
for name, (t, n) in agg.items():
    print(f"| {name} | {t} | {n / t:.4f} | {math.exp(n / t):.4f} | {100 * (math.exp(n / t) / base - 1):+.2f}% |")
PY
