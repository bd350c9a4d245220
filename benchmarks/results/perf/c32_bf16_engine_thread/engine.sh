set -x
cd /work/main
source /work/venv/bin/activate
OUT=benchmarks/results/perf/c32_bf16_engine_thread
mkdir -p $OUT
wait_health() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
python -m pdserve serve --model /work/q05 --backend engine --port 45181 --max-model-len 4096 --log-level warning --dtype bfloat16 & P=$!
wait_health 45181
python -m pdserve bench --base-url http://127.0.0.1:45181 --model q05 --dataset-name random --random-input-len 128 --random-output-len 8 --num-prompts 2 --max-concurrency 2 --seed 7300 --label warm --output /tmp/w/warm.json --disable-tqdm
python -m pdserve bench --base-url http://127.0.0.1:45181 --model q05 --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 64 --max-concurrency 32 --seed 7301 --label engine-bf16 --output $OUT/engine_$R.json --disable-tqdm
kill $P; wait $P
