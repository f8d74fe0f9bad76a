"""Fixtures shared by more than one test module. Helpers that are not fixtures live in the support
modules beside this file: ``dag_models.py``, ``jobfiles.py``, ``planning_support.py``, ``wire_support.py``,
``deploy_support.py``, ``probes.py``; the swarm harness is ``fusionnet.runtime.process_swarm``.

Tiers: ``pytest -m "not swarm"`` is the fast tier (no daemon processes, no real DHT); the full suite is
``scripts/test.sh``.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from fusionnet.job.loader import load_job
from fusionnet.planning.optimizers import job_optimizers
from fusionnet.planning.placement import JobShape
from fusionnet.runtime.prepare import trace_job
from tests.jobfiles import REPO


@pytest.fixture(scope="session", autouse=True)
def ctrl_c_reaches_children() -> Iterator[None]:
    """Tests press Ctrl-C (SIGINT) on the daemons and clients they start. A suite launched as a shell
    script's background job (``.ci/run &``) starts with SIGINT ignored, which every child inherits, and
    those tests would then wait on processes that never see the key: the default is restored here."""
    before = signal.getsignal(signal.SIGINT)
    if before == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session", autouse=True)
def submitter_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Every submit, cancel, results of the session (in process or in a child) signs with one key made
    in a scratch ``FUSIONNET_HOME``, never in the user's own ``~/.fusionnet``."""
    saved = {k: os.environ.get(k) for k in ("FUSIONNET_HOME", "FUSIONNET_KEY")}
    os.environ["FUSIONNET_HOME"] = str(tmp_path_factory.mktemp("fusionnet-home"))
    os.environ.pop("FUSIONNET_KEY", None)
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


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
