#!/usr/bin/env bash
# The README's test command: full set-up, then the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
. .venv/bin/activate
export FUSIONNET_REQUIRE_PROMETHEUS=1
ruff check fusionnet tests benchmarks examples
python -m pytest -q "$@"
