"""Slices of state staged ahead of their assignment: the broker's part stream (``results.slice_stream``),
the compnode's store (``compnode.staging``), and a job on a real swarm whose slices all travel so."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_blob
from safetensors.torch import load_file, save_file

from fusionnet.broker.tensorfiles import StreamedFile, TensorFiles
from fusionnet.compnode import staging as staging_module
from fusionnet.compnode.staging import MAX_STAGINGS, StateStaging
from fusionnet.errors import JobError, WireError
from fusionnet.job.loader import load_job
from fusionnet.messages.compnode_rpc import AssignRequest, StageStateRequest
from fusionnet.reference import run_reference
from fusionnet.results.slice_stream import SliceStream
from fusionnet.runtime.process_swarm import running_swarm
from fusionnet.runtime.submit import submit_and_wait
from tests.jobfiles import example_job


def _tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "a.weight": torch.randn(37, 11, generator=g),
        "b.bias": torch.randn(5, generator=g).to(torch.bfloat16),
        "c.steps": torch.arange(7, dtype=torch.int64),
        "d.empty": torch.zeros(0, 3),
        "e.mask": torch.tensor([True, False, True]),
    }


def _joined(stream: SliceStream, part: int) -> bytes:
    parts = list(stream.parts(part))
    assert all(len(p) == part for p in parts[:-1]) and 0 < len(parts[-1]) <= part
    return b"".join(parts)


@pytest.mark.parametrize("part", [1, 7, 64, 1000, 1 << 20])
def test_a_slice_streamed_in_parts_is_the_safetensors_of_its_keys(part: int, tmp_path: Path) -> None:
    tensors = _tensors()
    keys = ["e.mask", "a.weight", "d.empty", "b.bias"]  # a subset, in the order asked
    in_memory = SliceStream(tensors, keys)
    # On disk in two files, a key in both (the later file wins, as for a checkpoint's parts).
    save_file({k: tensors[k] for k in ("a.weight", "b.bias")}, tmp_path / "one.safetensors")
    newer = {"e.mask": tensors["e.mask"], "d.empty": tensors["d.empty"], "a.weight": tensors["a.weight"]}
    save_file(newer, tmp_path / "two.safetensors")
    on_disk = SliceStream(
        TensorFiles.of_files([tmp_path / "one.safetensors", tmp_path / "two.safetensors"]), keys
    )
    for stream in (in_memory, on_disk):
        blob = _joined(stream, part)
        assert len(blob) == stream.total
        got = load_blob(blob)
        assert sorted(got) == sorted(keys)
        for k in keys:
            assert got[k].dtype == tensors[k].dtype and torch.equal(got[k], tensors[k])


def _part(offset: int, data: bytes, total: int, **kw: object) -> StageStateRequest:
    fields = {"job_id": "job1", "attempt": 1, "subdag": 0, "kind": "state"} | kw
    return StageStateRequest(offset=offset, total=total, data=data, **fields)


def test_staging_takes_parts_in_order_and_an_assign_takes_the_slice() -> None:
    blob = bytes(range(256)) * 10
    store = StateStaging(ttl=60)
    assert store.add("B", _part(0, blob[:1000], len(blob))) == 1000
    assert store.add("B", _part(0, blob[:1000], len(blob))) == 1000  # a retried part
    with pytest.raises(JobError, match="parts come in order"):
        store.add("B", _part(2000, blob[2000:], len(blob)))
    with pytest.raises(JobError, match="total 5000 bytes"):
        store.add("B", _part(1000, blob[1000:1005], 5000))
    assert store.add("B", _part(1000, blob[1000:], len(blob))) == len(blob)
    with pytest.raises(ValueError, match="beyond"):
        _part(2500, b"xx" * 100, len(blob))
    assert store.staged_bytes == len(blob)
    with pytest.raises(JobError, match="first part at offset 5"):
        store.add("B", _part(5, b"x", 10, subdag=1))


def test_resolve_puts_staged_slices_in_and_refuses_missing_or_short_ones() -> None:
    store = StateStaging(ttl=60)
    full = b"s" * 50
    store.add("B", _part(0, full, 50))
    store.add("B", _part(0, b"o" * 10, 30, kind="optim"))
    request = AssignRequest.model_construct(
        job_id="job1", attempt=1, subdag=0, state=b"", optim=None, staged_state=50, staged_optim=30
    )
    with pytest.raises(JobError, match="10 of 30 bytes staged"):
        store.resolve("B", request)
    with pytest.raises(JobError, match="nothing was staged"):
        store.resolve("Other", request)  # another broker's assignment sees none of B's parts
    store.add("B", _part(10, b"o" * 20, 30, kind="optim"))
    done = store.resolve("B", request)
    assert bytes(done.state) == full and bytes(done.optim) == b"o" * 30
    assert store.staged_bytes == 0  # taken
    plain = AssignRequest.model_construct(job_id="job1", attempt=1, subdag=0, state=b"s", staged_state=None)
    assert store.resolve("B", plain) is plain


def test_staging_is_bounded_expires_and_goes_with_its_job(monkeypatch: pytest.MonkeyPatch) -> None:
    store = StateStaging(ttl=60)
    for i in range(MAX_STAGINGS):
        store.add("B", _part(0, b"x", 2, subdag=i))
    with pytest.raises(JobError, match=f"{MAX_STAGINGS} stagings of this broker already open"):
        store.add("B", _part(0, b"x", 2, subdag=99))
    store.add("C", _part(0, b"x", 2))  # another broker has its own allowance
    store.drop_job("job1")
    assert store.staged_bytes == 0
    monkeypatch.setattr(staging_module, "available_memory", lambda: 1000)
    with pytest.raises(JobError, match="does not fit"):
        store.add("B", _part(0, b"x", 10_000))
    store.add("B", _part(0, b"x", 100))
    store.ttl = 0.0
    store.expire()
    assert store.staged_bytes == 0


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_job_whose_slices_are_all_staged_in_tiny_parts_equals_pytorch(tmp_path: Path) -> None:
    """Every slice sent in 2 KB parts (dozens of ``stage_state`` calls each)."""
    job_path = example_job(
        "gpt",
        tmp_path,
        steps=3,
        optimizer={"name": "sgd", "lr": 0.05, "kwargs": {"momentum": 0.9}},
        placement={"compnodes": 2},
    )
    with running_swarm(tmp_path / "swarm", [{}, {}], broker_kw={"stage_part_mb": 0.002}) as sw:
        out = tmp_path / "out"
        asyncio.run(submit_and_wait(job_path, sw.initial_peers, out, timeout=180))
        logs = sw.dump_logs()
    placed = json.loads((out / "plan.json").read_text())["compnodes"]  # 1 or 2: the model decides
    assert logs.count("slice staged ahead") == len(placed) >= 1
    ref = run_reference(load_job(job_path))
    got = load_file(out / "weights.safetensors")
    assert max((got[k].double() - ref.weights[k].double()).abs().max().item() for k in got) <= 1e-5


def test_any_byte_range_of_the_stream_reads_the_same_bytes_from_memory_or_disk(tmp_path: Path) -> None:
    tensors = _tensors(3)
    keys = sorted(tensors)
    save_file(tensors, tmp_path / "all.safetensors")
    streams = [
        SliceStream(tensors, keys),
        SliceStream(TensorFiles.of_files([tmp_path / "all.safetensors"]), keys),
    ]
    whole = b"".join(streams[0].parts(1 << 20))
    g = torch.Generator().manual_seed(4)
    for _ in range(40):
        a, b = sorted(torch.randint(0, len(whole) + 1, (2,), generator=g).tolist())
        assert all(s.read(a, b) == whole[a:b] for s in streams)
    assert streams[1].chunks(100) == -(-len(whole) // 100) and streams[0].chunks(1 << 30) == 1
    with pytest.raises(ValueError, match="outside the stream"):
        streams[0].read_into(len(whole) - 2, memoryview(bytearray(5)))


def test_a_streamed_file_is_indexed_once_whole_and_refused_or_dropped_otherwise(tmp_path: Path) -> None:
    tensors = _tensors(5)
    whole = StreamedFile(tmp_path / "a.safetensors")
    for part in SliceStream(tensors, sorted(tensors)).parts(10):
        whole.append(part)
    got = whole.finish("state of sub-DAG 0").select(sorted(tensors))
    assert all(torch.equal(got[k], tensors[k]) for k in tensors)
    garbled = StreamedFile(tmp_path / "b.safetensors")
    garbled.append(b"\xff" * 20)
    with pytest.raises(WireError, match=r"b\.safetensors is not a valid safetensors file"):
        garbled.finish("state of sub-DAG 1")
    cut = StreamedFile(tmp_path / "c.safetensors")
    cut.append(b"half a file")
    cut.abandon()  # the peer failed mid-file
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors"]
