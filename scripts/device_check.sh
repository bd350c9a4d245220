#!/usr/bin/env bash
# Issue 43's device check in one device call (docs/BENCHMARKS.md, "GPU (H200)"): install the wheels
# that scripts/device_wheels.sh put in .whl/ (the device README's recipe), then run
# `python -m benchmarks.device_check` from this checkout (PYTHONPATH, no install), writing
# device_check.json, .txt and .log to $OUT (the device call's folder) or ./device-check-out.
# Arguments go to the check (`--dry-run` for a quick run at tiny sizes, `--phases`, `--budget-s`).
set -u
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if compgen -G ".whl/*.whl" > /dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || { echo "device_check.sh: installing the wheels in .whl/ failed" >&2; exit 2; }
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
exec "$PY" -m benchmarks.device_check --out "${OUT:-$PWD/device-check-out}" "$@"
