#!/usr/bin/env bash
# Download into .whl/ the Python packages pdserve and its device check need that the lent H200
# machine lacks (KINDS.md's package list for nvidia-h200), for Python 3.12 on manylinux x86-64, as the
# device README's recipe says; the device check installs them there (scripts/device_check.sh). Run it
# here, in the repository root of the checkout the device call sends.
#
# Missing there: pyproject's fastapi, fastapi-offline, uvicorn, pydantic, llguidance, crc32c and gguf,
# with what they need that is not there either (pydantic-core, starlette, annotated-types,
# typing-inspection, opentelemetry-api; typing-extensions at the version pydantic needs). transformers
# is there, at 5.17: the test suite's reference and the static baseline are pyproject's 5.23.0, so that
# travels too (its own needs are on the machine). Versions are this repository's pins.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
PACKAGES=(
  fastapi==0.163.2 fastapi-offline==1.7.7 uvicorn==0.54.0 pydantic==2.14.3 pydantic-core==2.50.4
  starlette==1.10.0 annotated-types==0.8.0 typing-inspection==0.4.5 typing-extensions==4.16.0
  opentelemetry-api==1.45.2 llguidance==1.9.1 crc32c==2.9.post0 gguf==0.19.0 transformers==5.23.0
)
grep -qxF /.whl/ "$(git rev-parse --git-common-dir)/info/exclude" 2>/dev/null || {
  mkdir -p "$(git rev-parse --git-common-dir)/info"
  echo /.whl/ >> "$(git rev-parse --git-common-dir)/info/exclude"
}
rm -rf .whl
# manylinux_2_31: llguidance's wheels need it (the machine's Python 3.12.3 is Ubuntu 24.04's, glibc 2.39)
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform manylinux1_x86_64 --platform manylinux_2_31_x86_64 \
  -d .whl "${PACKAGES[@]}"
count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "device_wheels.sh: expected ${#PACKAGES[@]} wheels in .whl/, got $count" >&2
  exit 1
fi
bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
echo "$count wheels, $((bytes / 1048576)) MiB; with the tracked tree, $(((bytes + tree) / 1048576)) MiB of the 64 MiB a device call carries"
