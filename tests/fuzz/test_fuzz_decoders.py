"""Fuzz every decoder for a bounded time: 0 crashes, 0 hangs, every refusal the project's own error.

``FUSIONNET_FUZZ_SECONDS`` sets the budget per decoder (default 3 s: about 25 s for all of them in
CI); ``FUSIONNET_FUZZ_SEED`` the random seed (default 0, so a CI failure reproduces);
``FUSIONNET_FUZZ_SAVE=1`` writes crashing inputs to ``corpus/<target>/`` for a regression seed.
The figures (executions per decoder) are printed.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

import pytest

from fusionnet.dag.guards import element_cap, set_element_cap
from tests.fuzz import rpc_targets as R
from tests.fuzz import targets as T
from tests.fuzz.harness import fuzz

SECONDS = float(os.environ.get("FUSIONNET_FUZZ_SECONDS", "3"))
SEED = int(os.environ.get("FUSIONNET_FUZZ_SEED", "0"))
CORPUS = Path(__file__).parent / "corpus"
REPO = Path(__file__).resolve().parents[2]
_TRACED = None


def _traced():
    global _TRACED
    if _TRACED is None:
        _TRACED = T._traced()
    return _TRACED


def _target(name: str) -> T.Target:
    if name == "ir_decode":
        return T.ir_target(_traced())
    if name == "ir_execute":
        return T.ir_execute_target(_traced())
    if name == "job_file":
        return T.job_file_target([p.read_bytes() for p in sorted(REPO.glob("examples/*/job.yaml"))])
    return {
        "frame_header": T.frame_header_target,
        "frame_reader": T.frame_reader_target,
        "tensor_blob": T.tensor_blob_target,
        "dht_record": T.dht_record_target,
        "value_structure": T.value_structure_target,
        "replica_frame": T.replica_frame_target,
        "sandbox_ipc": T.sandbox_ipc_target,
        "rpc_request": R.rpc_request_target,
        "rpc_reply": R.rpc_reply_target,
    }[name]()


NAMES = [
    "ir_decode",
    "ir_execute",
    "frame_header",
    "frame_reader",
    "tensor_blob",
    "dht_record",
    "job_file",
    "value_structure",
    "replica_frame",
    "sandbox_ipc",
    "rpc_request",
    "rpc_reply",
]


@pytest.mark.timeout(max(120, int(SECONDS * 4) + 60))
@pytest.mark.parametrize("name", NAMES)
def test_decoder_survives_fuzzing(name: str, capsys) -> None:
    target = _target(name)
    kept = sorted((CORPUS / name).glob("*")) if (CORPUS / name).is_dir() else []
    seeds = target.seeds + [p.read_bytes() for p in kept]
    with contextlib.suppress(Exception):  # first call: lazy imports (seconds), not the decoder's time
        target.call(target.seeds[0])
    old_cap = element_cap()
    set_element_cap(1 << 22)  # a mutant may ask for any size: keep this shared machine's memory safe
    try:
        result = fuzz(name, target.call, seeds, target.allowed, seconds=SECONDS, seed=SEED)
    finally:
        set_element_cap(old_cap)
    with capsys.disabled():
        print(f"\nfuzz {result.line()}")
    if os.environ.get("FUSIONNET_FUZZ_SAVE") == "1":
        for data, _ in result.crashes:
            (CORPUS / name).mkdir(parents=True, exist_ok=True)
            (CORPUS / name / hashlib.sha256(data).hexdigest()[:16]).write_bytes(data)
    assert result.execs >= len(seeds)
    assert not result.crashes, f"{len(result.crashes)} crashes, first: {result.crashes[0][1]}"
    assert not result.hangs, f"{len(result.hangs)} hangs, slowest {max(h[1] for h in result.hangs):.1f} s"
