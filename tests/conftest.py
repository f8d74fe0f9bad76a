"""Fixtures shared by more than one test module. Helpers that are not fixtures live in the support
modules beside this file: ``dag_models.py``, ``jobfiles.py``, ``planning_support.py``, ``wire_support.py``,
``deploy_support.py``, ``probes.py``; the swarm harness is ``fusionnet.runtime.process_swarm``.

Tiers: ``pytest -m "not swarm"`` is the fast tier (no daemon processes, no real DHT); the full suite is
``scripts/test.sh``.
"""

from __future__ import annotations

import pytest

from fusionnet.job.loader import load_job
from fusionnet.planning.optimizers import job_optimizers
from fusionnet.planning.placement import JobShape
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO


@pytest.fixture(scope="session")
def gpt() -> JobShape:
    """The bundled GPT example traced and shaped for placement (3 sub-DAGs wanted)."""
    job = load_job(REPO / "examples" / "gpt" / "job.yaml")
    graph = trace_job(job).graph
    return JobShape(
        graph=graph,
        wanted=3,
        microbatches=job.spec.data.microbatches,
        batch_size=job.spec.data.batch_size,
        optimizer=job_optimizers(job, graph),
    )
