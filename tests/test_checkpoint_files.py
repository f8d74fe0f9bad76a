"""The broker's job state on disk (issue 11: its memory independent of model size): the submitted state
and checkpoints are read when asked for, a compnode's blob is kept as it came, a checkpoint survives a
reload (broker restart) and the deletion of the one before it, and garbage from a peer is refused."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch

from fusionnet.broker.checkpoints import Checkpoint, JobFiles
from fusionnet.broker.replicas import assemble_checkpoint
from fusionnet.broker.tensorfiles import TensorFiles
from fusionnet.errors import FusionNetError, WireError
from fusionnet.messages.blobs import pack_tensors

pytestmark = pytest.mark.timeout(60)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(3, 4, generator=g) for k in ("a.weight", "b.weight", "c.weight", "unused")}


def _files(tmp_path: Path) -> JobFiles:
    files = JobFiles(tmp_path / "job")
    data = {"inputs": torch.arange(6).reshape(3, 2)}
    files.save_submission({"name": "x"}, b"ir", _state(), data)
    return files


def test_submitted_state_is_read_from_disk_when_asked(tmp_path: Path) -> None:
    files = _files(tmp_path)
    state = files.submitted_state()
    assert isinstance(state, TensorFiles) and sorted(state) == sorted(_state())
    assert "a.weight" in state and "nope" not in state
    for k, v in _state().items():
        assert torch.equal(state[k], v)
    ckpt = Checkpoint(0, state, {"opt::a.weight::momentum_buffer": torch.ones(3, 4)})
    sub_state, sub_optim = ckpt.for_subdag(["a.weight"], ["c.weight"])
    assert sorted(sub_state) == ["a.weight", "c.weight"] and sorted(sub_optim) == [
        "opt::a.weight::momentum_buffer"
    ]


def test_a_checkpoint_of_peer_blobs_reloads_and_outlives_the_one_before(tmp_path: Path) -> None:
    files = _files(tmp_path)
    base = files.submitted_state()
    new_a = {"a.weight": torch.full((3, 4), 7.0)}
    optim = {"opt::a.weight::momentum_buffer": torch.full((3, 4), 0.5)}
    state = base.merged(files.write_part(1, "s0-state", pack_tensors(new_a), "state"))
    opt_files = files.write_part(1, "s0-optim", pack_tensors(optim), "optim")
    files.save_checkpoint(Checkpoint(1, state, opt_files, [{"step": 0}]), attempt=1)

    # The next checkpoint holds "b" in memory only; "a" still lives in ckpt-1, which is deleted.
    new_b = {"b.weight": torch.full((3, 4), 9.0)}
    files.save_checkpoint(Checkpoint(2, {**dict(state.select(list(state))), **new_b}, {}), attempt=2)
    assert not (files.folder / "ckpt-1").exists()
    loaded = files.load_checkpoint()
    assert loaded is not None
    ckpt, attempt = loaded
    assert ckpt.step == 2 and attempt == 2 and len(ckpt.optim) == 0
    assert torch.equal(ckpt.state["a.weight"], new_a["a.weight"])
    assert torch.equal(ckpt.state["b.weight"], new_b["b.weight"])
    assert torch.equal(ckpt.state["unused"], _state()["unused"])


def test_a_checkpoints_metrics_rows_are_appended_once_and_read_back_after_a_restart(tmp_path: Path) -> None:
    """``ckpt.json`` names its rows in ``rows-ckpt.*.jsonl`` (``broker.step_rows``) instead of holding
    them: a save appends the new rows only, so its cost no longer grows with the job."""
    files = _files(tmp_path)
    rows = [{"step": s, "loss": 1.0 / (s + 1)} for s in range(200)]
    files.save_checkpoint(Checkpoint(100, files.submitted_state(), {}, rows[:100]), attempt=1)
    files.save_checkpoint(Checkpoint(200, files.submitted_state(), {}, rows), attempt=1)
    assert len((files.folder / "ckpt.json").read_bytes()) < 1000
    (log,) = files.folder.glob("rows-ckpt.*.jsonl")
    assert len(log.read_text().splitlines()) == 200  # each row once
    loaded = JobFiles(files.folder).load_checkpoint()  # a restarted broker's
    assert loaded is not None and loaded[0].metrics == rows


def test_a_checkpoint_keeps_untouched_keys_in_the_submission(tmp_path: Path) -> None:
    files = _files(tmp_path)
    part = files.write_part(1, "s0-state", pack_tensors({"a.weight": torch.zeros(3, 4)}), "state")
    files.save_checkpoint(Checkpoint(1, files.submitted_state().merged(part), {}), attempt=1)
    loaded = files.load_checkpoint()
    assert loaded is not None
    state = loaded[0].state
    assert isinstance(state, TensorFiles)
    assert state.index["unused"] == files.submission / "state.safetensors"
    assert torch.equal(state["a.weight"], torch.zeros(3, 4))
    assert not list(files.checkpoint_dir(1).glob("rest-*"))  # nothing had to be copied


@pytest.mark.parametrize("blob", [b"", b"garbage", pack_tensors({"x": torch.ones(4)})[:-3]])
def test_a_bad_blob_from_a_peer_is_refused_and_not_kept(tmp_path: Path, blob: bytes) -> None:
    files = _files(tmp_path)
    with pytest.raises(WireError, match="state from peer"):
        files.write_part(1, "s0-state", blob, "state from peer")
    assert not list(files.checkpoint_dir(1).glob("*.safetensors"))


def test_an_earlier_versions_checkpoint_still_loads_and_is_replaced(tmp_path: Path) -> None:
    import json

    from safetensors.torch import save_file

    files = _files(tmp_path)
    a, m = torch.full((3, 4), 2.0), torch.full((3, 4), 3.0)
    save_file(
        {"state::a.weight": a, "opt::a.weight::momentum_buffer": m}, str(files.folder / "ckpt-3.safetensors")
    )
    doc = {"step": 3, "file": "ckpt-3.safetensors", "attempt": 4, "metrics": []}
    (files.folder / "ckpt.json").write_text(json.dumps(doc))
    loaded = files.load_checkpoint()
    assert loaded is not None and loaded[0].step == 3 and loaded[1] == 4
    assert torch.equal(loaded[0].state["a.weight"], a)
    assert torch.equal(loaded[0].optim["opt::a.weight::momentum_buffer"], m)
    files.save_checkpoint(loaded[0], attempt=5)
    assert not (files.folder / "ckpt-3.safetensors").exists()
    again = files.load_checkpoint()
    assert again is not None and torch.equal(again[0].optim["opt::a.weight::momentum_buffer"], m)


def test_the_settled_spec_replaces_the_submitted_one_and_the_rest_stays(tmp_path: Path) -> None:
    """``data.microbatches: auto`` settled at the first placement is what a resumed job reads back."""
    files = _files(tmp_path)
    files.save_spec({"name": "x", "microbatches": 4, "microbatch_choices": []})
    spec, ir, state, data = files.load_submission()
    assert spec == {"name": "x", "microbatches": 4, "microbatch_choices": []}
    assert (
        ir == b"ir"
        and sorted(state) == sorted(_state())
        and torch.equal(data["inputs"], torch.arange(6).reshape(3, 2))
    )
    assert not list(files.submission.glob("*.tmp"))


def _blob_parts(tensors: dict[str, torch.Tensor], size: int) -> list[bytes]:
    blob = pack_tensors(tensors)
    return [blob[i : i + size] for i in range(0, len(blob), size)]


def test_sub_dags_are_collected_side_by_side_and_merged_in_sub_dag_order(tmp_path: Path) -> None:
    """``assemble_checkpoint``: every sub-DAG's answers come at once (each waits for the others' first
    answer before it goes on), the files read back as sent, and a tensor two sub-DAGs hold is the later
    sub-DAG's, as when they came one after the other."""
    files = _files(tmp_path)
    held = [
        {"a.weight": torch.full((3, 4), 1.0), "c.weight": torch.full((3, 4), 5.0)},
        {"b.weight": torch.full((3, 4), 2.0), "c.weight": torch.full((3, 4), 6.0)},
        {"unused": torch.full((3, 4), 3.0)},
    ]
    optim = {"opt::a.weight::momentum_buffer": torch.full((3, 4), 0.5)}
    started: set[int] = set()
    everyone = asyncio.Event()

    async def parts(i: int, peer: str) -> Any:
        assert peer == f"peer{i}"
        state_parts = _blob_parts(held[i], 64)
        for n, data in enumerate(state_parts):
            yield "state", data, n == len(state_parts) - 1
            started.add(i)
            if len(started) == len(held):
                everyone.set()
            await asyncio.wait_for(everyone.wait(), 5)
        if i == 0:
            yield "optim", pack_tensors(optim), True

    base = Checkpoint(0, files.submitted_state())
    peers = [f"peer{i}" for i in range(3)]
    ckpt = asyncio.run(assemble_checkpoint(files, 1, base, peers, parts, "a1"))
    assert torch.equal(ckpt.state["a.weight"], held[0]["a.weight"])
    assert torch.equal(ckpt.state["b.weight"], held[1]["b.weight"])
    assert torch.equal(ckpt.state["c.weight"], held[1]["c.weight"])  # the later sub-DAG's
    assert torch.equal(ckpt.state["unused"], held[2]["unused"])
    assert torch.equal(ckpt.optim["opt::a.weight::momentum_buffer"], optim["opt::a.weight::momentum_buffer"])


def test_a_compnode_failing_mid_file_fails_the_collection_and_leaves_no_partial_file(tmp_path: Path) -> None:
    files = _files(tmp_path)
    going = asyncio.Event()
    waiting: list[int] = []
    cancelled: list[int] = []

    async def parts(i: int, peer: str) -> Any:
        first, *rest = _blob_parts({"a.weight": torch.ones(30, 40)}, 256)
        yield "state", first, False
        if i == 1:
            await asyncio.wait_for(going.wait(), 5)
            raise FusionNetError(f"compnode {peer} (collect): connection lost")
        waiting.append(i)
        if len(waiting) == 2:  # fail only once both others wait in here (not in a write's thread)
            going.set()
        try:
            await asyncio.Event().wait()  # the others are still coming when one fails
        except asyncio.CancelledError:
            cancelled.append(i)
            raise
        for n, data in enumerate(rest):
            yield "state", data, n == len(rest) - 1

    base = Checkpoint(0, files.submitted_state())
    with pytest.raises(FusionNetError, match=r"compnode peer1 \(collect\): connection lost"):
        asyncio.run(assemble_checkpoint(files, 1, base, ["peer0", "peer1", "peer2"], parts, "a1"))
    assert sorted(cancelled) == [0, 2]
    assert not list(files.checkpoint_dir(1).glob("a1-*"))  # every file cut short was abandoned
