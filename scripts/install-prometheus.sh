#!/usr/bin/env bash
# Installs the Prometheus server and promtool (Debian/Ubuntu package) that the monitoring tests use:
# promtool checks deploy/*.yml, and tests/test_prometheus_live.py scrapes a real swarm.
# Idempotent: does nothing when both binaries are already on PATH.
set -euo pipefail

if command -v prometheus >/dev/null 2>&1 && command -v promtool >/dev/null 2>&1; then
  echo "prometheus and promtool already installed: $(prometheus --version 2>&1 | head -n 1)"
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-prometheus.sh: no apt-get here; install prometheus and promtool (>= 2.30) yourself" >&2
  exit 1
fi
SUDO=""
if [ "$(id -u)" -ne 0 ]; then
  if ! command -v sudo >/dev/null 2>&1; then
    echo "install-prometheus.sh: need root (or sudo) to apt-get install prometheus" >&2
    exit 1
  fi
  SUDO="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
# --no-install-recommends: the server and promtool only, not node-exporter and friends.
$SUDO apt-get install -y -q --no-install-recommends prometheus
prometheus --version 2>&1 | head -n 1
promtool --version 2>&1 | head -n 1
