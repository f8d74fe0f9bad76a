#!/usr/bin/env bash
# The README's demo command: set-up, then a whole local swarm (broker + 3 compnodes) on loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
FUSIONNET_SKIP_PROMETHEUS=1 scripts/setup.sh
. .venv/bin/activate
exec fusionnet demo "$@"
