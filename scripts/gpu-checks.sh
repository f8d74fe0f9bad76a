#!/usr/bin/env bash
# The GPU checks of issue 11 in one go, as run on a lent CUDA machine (the workplace's `device` tool,
# whose image has torch but not hivemind & co.: those travel as wheels in .whl/, see README "Large
# models"). Runs the `gpu`-marked tests, then benchmarks/scale.py on CUDA compnodes; everything it
# prints is also written under $OUT (default /tmp/gpu-checks).
#   scripts/gpu-checks.sh [tests] [billion] [quick] [full]   (default the first three: the tests, the
#   1.1B run, the ~9M run with a SIGKILL; full: the default 125M model without one); BILLION_TIMEOUT,
#   QUICK_TIMEOUT and FULL_TIMEOUT bound the runs (s).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu-checks}
WHAT=" ${*:-tests billion quick} "
want() { [[ "$WHAT" == *" $1 "* ]]; }
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PY=python3
if [ -x .venv/bin/python ]; then PY=.venv/bin/python; fi
if [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    || exit 1
  export PYTHONPATH=/tmp/site:$PWD
fi
{ nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; nproc; free -g | head -2
  "$PY" -c 'import torch, hivemind, transformers; print("torch", torch.__version__, "hivemind", hivemind.__version__,
"transformers", transformers.__version__, "cuda", torch.cuda.is_available())'; } 2>&1 | tee "$OUT/machine.txt"
if want tests; then
  timeout -s INT -k 20 200 "$PY" -m pytest -q -p no:cacheprovider -m gpu tests/test_devices.py tests/test_gpu_swarm.py \
    2>&1 | tee "$OUT/pytest-gpu.txt" | tail -40
fi
if want billion; then
  timeout -s INT -k 30 ${BILLION_TIMEOUT:-360} "$PY" benchmarks/scale.py --billion --device cuda --placement balanced --steps 3 --no-kill \
    --workdir /tmp/scale-1b 2>&1 | tee "$OUT/scale-1b.txt"
  tar czf "$OUT/scale-1b-logs.tgz" -C /tmp/scale-1b --exclude='*.safetensors' --exclude='*.bin' . 2>/dev/null
fi
if want quick; then
  timeout -s INT -k 30 ${QUICK_TIMEOUT:-180} "$PY" benchmarks/scale.py --quick --device cuda --steps 3 \
    --workdir /tmp/scale-quick 2>&1 | tee "$OUT/scale-quick.txt"
  tar czf "$OUT/scale-quick-logs.tgz" -C /tmp/scale-quick --exclude='*.safetensors' . 2>/dev/null
fi
if want full; then
  timeout -s INT -k 20 ${FULL_TIMEOUT:-240} "$PY" benchmarks/scale.py --device cuda --placement balanced --steps 3 \
    --no-kill --workdir /tmp/scale-full 2>&1 | tee "$OUT/scale-full.txt"
fi
