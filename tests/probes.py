"""Looking at a running swarm from a test the way an operator does: the ``status`` command and the
Prometheus endpoints. (Starting and stopping the swarm is ``fusionnet.runtime.process_swarm``.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

from tests.jobfiles import REPO


def scrape(url: str, timeout: float = 10.0) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """A Prometheus text endpoint as {(sample name, sorted labels): value}."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(url, timeout=timeout) as response:
        text = response.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def run_status_cli(initial_peers: Sequence[str], timeout: float = 60.0) -> tuple[int, dict[str, Any]]:
    """``fusionnet status --json`` as a user runs it: (exit code, parsed document)."""
    out = subprocess.run(
        [sys.executable, "-m", "fusionnet.cli.main", "status", "--initial-peers", *initial_peers, "--json"],
        capture_output=True,
        cwd=REPO,
        timeout=timeout,
        env=dict(os.environ, HIVEMIND_LOGLEVEL="WARNING"),
    )
    try:
        return out.returncode, json.loads(out.stdout)
    except json.JSONDecodeError as e:
        raise AssertionError(
            f"status printed no JSON (exit {out.returncode}):\n{out.stdout!r}\n{out.stderr.decode()}"
        ) from e
