"""Devices (``compnode --device``): the placement helpers, an executor given its device explicitly, a
device OOM that fails the sub-task (not the daemon) and makes the broker place the job without that
compnode, the start-up error without CUDA, and D_gpu as the memory the planner checks. Tests marked
``gpu`` run the same pipeline on CUDA and skip where there is none."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from fusionnet.broker.failures import FailureWatch, PeerFailure
from fusionnet.dag.channel import LocalHub
from fusionnet.dag.devices import (
    HOST,
    host_copy,
    host_ready,
    is_out_of_memory,
    resolve_device,
    to_device,
    to_host,
)
from fusionnet.dag.executor import SubDagExecutor
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dag.trace import trace_model
from fusionnet.errors import DeviceMemoryError, ExecutionError
from fusionnet.runtime.batches import iter_steps
from tests.dag_models import SkipEverywhere, make_data

pytestmark = pytest.mark.timeout(120)
CUDA = torch.cuda.is_available()
gpu = pytest.mark.gpu


# ---- placement helpers -----------------------------------------------------------------------------
def test_the_cpu_resolves_and_bad_names_are_refused() -> None:
    assert resolve_device("cpu") == HOST
    with pytest.raises(ValueError, match="not a torch device"):
        resolve_device("tpu-ish")


@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_cuda_without_cuda_is_a_clear_error() -> None:
    for name in ("cuda", "cuda:1"):
        with pytest.raises(ValueError, match=f"--device {name}: CUDA is not available"):
            resolve_device(name)


@pytest.mark.skipif(torch.backends.mps.is_available(), reason="this machine has MPS")
def test_mps_without_mps_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="--device mps: MPS is not available"):
        resolve_device("mps")


def test_on_the_cpu_values_cross_without_copies() -> None:
    t = torch.randn(3, 4, requires_grad=True)
    value = {"a": [t, None], "b": 3}
    assert to_device(value, HOST) is value  # nothing moves
    host, ready = to_host(value, HOST)
    assert ready is None and host["b"] == 3 and host["a"][1] is None
    out = host["a"][0]
    assert not out.requires_grad and out.data_ptr() == t.data_ptr()  # a detach, not a copy
    asyncio.run(host_ready(ready))
    copies = host_copy({"t": t})
    assert copies["t"].data_ptr() != t.data_ptr() and torch.equal(copies["t"], t.detach())


def test_out_of_memory_errors_are_told_apart() -> None:
    assert is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert is_out_of_memory(RuntimeError("MPS backend out of memory"))
    assert is_out_of_memory(torch.cuda.OutOfMemoryError("CUDA error: out of memory"))
    assert not is_out_of_memory(RuntimeError("shape mismatch"))
    assert not is_out_of_memory(ValueError("out of memory"))  # only torch's RuntimeErrors


@pytest.mark.timeout(120)
def test_the_irs_devices_become_the_executors(tmp_path: Path) -> None:
    """Export graphs carry the tracer's device as constants (rotary's ``arange(..., device=cpu)``,
    ``_assert_tensor_metadata(..., device=cpu)``): a compnode elsewhere must make those tensors where it
    computes. A Llama on CUDA compnodes failed "Tensor device mismatch! Expected: cpu, Got: cuda:0"."""
    from fusionnet.dag.ir import decode_kwargs, decode_value
    from fusionnet.dag.rebuild import build_subdag_module
    from fusionnet.job.loader import load_job
    from fusionnet.runtime.prepare import trace_job
    from tests.jobfiles import write_token_job

    cuda = torch.device("cuda", 0)  # a device object needs no CUDA
    assert decode_value({"$device": "cpu"}, None) == HOST
    assert decode_value([{"$tuple": [{"$device": "cpu"}, 3]}], None, cuda) == [(cuda, 3)]
    assert decode_kwargs({"device": {"$device": "cuda:1"}}, None, cuda) == {"device": cuda}
    traced = trace_job(load_job(write_token_job(tmp_path / "job", "HFDecoder", family="llama")))
    meta = torch.device("meta")
    found: list[torch.device] = []
    for sd in build_partition(traced.graph, balanced_assignment(traced.graph, 2)).subdags:
        state = traced.state
        gm, _ = build_subdag_module(
            traced.graph,
            sd.nodes,
            sd.outer_required,
            list(sd.outwards),
            {k: state[k] for k in sd.params},
            {k: state[k] for k in sd.buffers},
            meta,
        )
        for node in gm.graph.nodes:
            torch.fx.node.map_aggregate(
                (node.args, node.kwargs), lambda a: found.append(a) if isinstance(a, torch.device) else a
            )
    assert found and set(found) == {meta}, found[:5]


# ---- the executor on an explicit device --------------------------------------------------------------
def _pipeline(
    device: str, pieces: int = 2, own_state: bool = False
) -> tuple[list[SubDagExecutor], list[Any]]:
    """``own_state``: each executor gets a copy of the state of its own and keeps it (a compnode's
    unpacked slice), instead of copying what it reads of the one model's state."""
    torch.manual_seed(0)
    x, y = make_data("skip", n=8)
    traced = trace_model(SkipEverywhere(), x, y, F.cross_entropy, "train")
    partition = build_partition(traced.graph, balanced_assignment(traced.graph, pieces))
    hub = LocalHub(pieces)

    def sgd(named: Any) -> list[torch.optim.Optimizer]:
        return [torch.optim.SGD(list(named.values()), lr=0.1, momentum=0.9)]

    executors = [
        SubDagExecutor(
            traced.graph,
            s,
            {k: v.clone() for k, v in traced.state.items()} if own_state else traced.state,
            hub.channel(s.index),
            task="train",
            make_optimizers=sgd,
            subdags=pieces,
            device=torch.device(device),
            own_state=own_state,
        )
        for s in partition.subdags
    ]
    return executors, list(iter_steps("train", x, y, 8, 2, 3))


def _train(executors: list[SubDagExecutor], steps: list[Any]) -> list[float | None]:
    async def run() -> list[float | None]:
        losses = []
        for data in steps:
            reports = await asyncio.gather(
                *(
                    ex.run_step(data.step, [dict(mb) for mb in data.microbatches], data.sizes)
                    for ex in executors
                )
            )
            losses.append(next(r.loss for r in reports if r.loss is not None))
        return losses

    return asyncio.run(run())


def _trained(device: str) -> tuple[list[float | None], dict[str, torch.Tensor]]:
    executors, steps = _pipeline(device)
    losses = _train(executors, steps)
    state: dict[str, torch.Tensor] = {}
    for ex in executors:
        assert all(p.device.type == torch.device(device).type for p in ex.named_params.values())
        state |= ex.state()
    assert all(t.device == HOST for t in state.values())  # results come back as CPU tensors
    return losses, state


def test_an_explicit_cpu_device_gives_the_default_bits() -> None:
    losses, state = _trained("cpu")
    executors, steps = _pipeline("cpu")
    for ex in executors:  # the default: no device argument
        ex.device = HOST
    assert _train(executors, steps) == losses
    default = {k: v for ex in executors for k, v in ex.state().items()}
    assert all(torch.equal(default[k], state[k]) for k in state)


def test_an_executor_that_owns_its_state_keeps_it_uncopied_and_trains_the_same_bits() -> None:
    torch.manual_seed(0)
    x, y = make_data("skip", n=8)
    traced = trace_model(SkipEverywhere(), x, y, F.cross_entropy, "train")
    (subdag,) = build_partition(traced.graph, balanced_assignment(traced.graph, 1)).subdags
    mine = {k: v.clone() for k, v in traced.state.items()}
    owner = SubDagExecutor(traced.graph, subdag, mine, LocalHub(1).channel(0), task="train", own_state=True)
    reader = SubDagExecutor(traced.graph, subdag, traced.state, LocalHub(1).channel(0), task="train")
    for key, param in owner.named_params.items():
        assert param.data_ptr() == mine[key].data_ptr()  # one copy of a slice, not two
        assert reader.named_params[key].data_ptr() != traced.state[key].data_ptr()  # the model untouched
    losses, state = _trained("cpu")
    executors, steps = _pipeline("cpu", own_state=True)
    assert _train(executors, steps) == losses
    owned = {k: v for ex in executors for k, v in ex.state().items()}
    assert all(torch.equal(owned[k], state[k]) for k in state)


def test_a_device_oom_fails_the_sub_task_with_a_clear_error_and_frees_the_step() -> None:
    executors, steps = _pipeline("cpu", pieces=1)
    (ex,) = executors

    def oom(*args: Any) -> Any:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    ex.module = oom  # type: ignore[assignment]
    data = steps[0]
    with pytest.raises(DeviceMemoryError, match="FP of step 0 micro-batch 0 ran out of memory on cpu"):
        asyncio.run(ex.run_step(0, [dict(mb) for mb in data.microbatches], data.sizes))
    ex.drop_inflight()
    assert not ex._stash and all(p.grad is None for p in ex.named_params.values())


def test_other_failures_stay_execution_errors() -> None:
    executors, steps = _pipeline("cpu", pieces=1)
    (ex,) = executors
    ex.module = lambda *a: (_ for _ in ()).throw(RuntimeError("shape mismatch"))  # type: ignore[assignment]
    data = steps[0]
    with pytest.raises(ExecutionError, match="FP of step 0 micro-batch 0 failed") as info:
        asyncio.run(ex.run_step(0, [dict(mb) for mb in data.microbatches], data.sizes))
    assert not isinstance(info.value, DeviceMemoryError)


# ---- the broker: an OOM is no death, but the job moves off that compnode -----------------------------
class _Registry:
    def add_listener(self, listener: Any) -> None: ...
    def remove_listener(self, listener: Any) -> None: ...


def test_a_device_oom_reads_as_an_unfit_compnode_not_a_failed_job() -> None:
    context = type("C", (), {"registry": _Registry(), "compnodes": None})()
    watch = FailureWatch(context, lambda: ["peer-a", "peer-b"], set())  # type: ignore[arg-type]

    async def step() -> None:
        raise DeviceMemoryError("compnode peer-b (step): ran out of memory", peer="peer-b")

    with pytest.raises(PeerFailure) as info:
        asyncio.run(watch.guarded(step()))
    assert info.value.dead == {"peer-b"} and info.value.unfit


# ---- start-up and the record ---------------------------------------------------------------------------
@pytest.mark.skipif(CUDA, reason="this machine has CUDA")
def test_compnode_device_cuda_without_cuda_fails_at_start_up(capsys: pytest.CaptureFixture[str]) -> None:
    from fusionnet.cli.main import main

    code = main(
        [
            "compnode",
            "--initial-peers",
            "/ip4/127.0.0.1/tcp/1/p2p/12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa",
            "--device",
            "cuda",
        ]
    )
    assert code == 2
    assert "--device cuda: CUDA is not available on this machine" in capsys.readouterr().err


def test_an_announced_gpu_is_planned_by_its_device_memory() -> None:
    from fusionnet.broker.registry import CompnodeEntry
    from fusionnet.dht.records import CompnodeRecord, HardwareInfo, NodeState

    hw = HardwareInfo(
        device_kind="cuda",
        device_name="H100",
        peak_flops=1e15,
        speed_factor=1.0,
        d_gpu=80 << 30,
        d_cpu=1 << 30,
        mem_bandwidth=3e12,
    )
    record = CompnodeRecord(peer_id="12D3KooW" + "A" * 44, state=NodeState.ONLINE, hardware=hw)
    spec = CompnodeEntry(record=record, expires_at=0.0, first_seen=0.0, last_seen=0.0).device_spec()
    assert spec.kind == "gpu" and spec.compute_memory == 80 << 30  # D_gpu, not the host's memory


# ---- on CUDA ---------------------------------------------------------------------------------------------
@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_on_cuda_values_cross_through_pinned_memory() -> None:
    device = resolve_device("cuda")
    t = torch.randn(64, 64)
    moved = to_device({"t": t}, device)["t"]
    assert moved.device.type == "cuda" and torch.equal(moved.cpu(), t)
    host, ready = to_host([moved * 2, None], device)
    asyncio.run(host_ready(ready))
    assert host[0].is_pinned() and torch.equal(host[0], t * 2) and host[1] is None


@gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA device")
def test_a_pipeline_on_cuda_equals_the_cpu() -> None:
    cpu_losses, cpu_state = _trained("cpu")
    cuda_losses, cuda_state = _trained("cuda")
    assert cuda_losses == pytest.approx(cpu_losses, rel=1e-5, abs=1e-6)
    worst = max((cpu_state[k] - cuda_state[k]).abs().max().item() for k in cpu_state)
    assert worst <= 1e-5
