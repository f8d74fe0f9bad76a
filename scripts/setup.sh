#!/usr/bin/env bash
# One-shot set-up on a fresh machine: venv, torch (CPU wheel) first, the package with its extras,
# and the Prometheus server the monitoring tests use. Idempotent: re-running is cheap.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
# torch first and pinned, so that nothing installed after it asks for another build. Which wheel
# `torch==2.13.0` resolves to is pip's configuration's: a CPU wheel where pip is pointed at one (this
# project's machines), PyPI's CUDA build on a plain Linux machine; FUSIONNET_TORCH_INDEX names an index
# to take it from instead (https://download.pytorch.org/whl/cpu for the CPU build).
python -c 'import torch, sys; sys.exit(0 if torch.__version__.startswith("2.13.0") else 1)' 2>/dev/null \
  || python -m pip install -q torch==2.13.0 ${FUSIONNET_TORCH_INDEX:+--index-url "$FUSIONNET_TORCH_INDEX"}
python -m pip install -q -e '.[dev,transformers,plot]'
if [ "${FUSIONNET_SKIP_PROMETHEUS:-0}" != "1" ] && [ -x scripts/install-prometheus.sh ]; then
  scripts/install-prometheus.sh
fi
