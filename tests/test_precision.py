"""Mixed precision (job key ``precision``): every runtime equals plain PyTorch under the same autocast.

What "equal" means here, and why:

- One micro-batch per batch: the executors run exactly the reference's ops in the same dtypes and order
  (autocast per sub-DAG makes the same casts as one autocast over the whole model), so weights and
  losses are equal bit for bit, for bf16 and fp16 alike, on 1, 2 or 3 virtual compnodes.
- Several micro-batches: the reference computes each weight gradient as one low-precision matmul over
  the whole batch, the executors as a sum of per-micro-batch ones, so results differ by the compute
  dtype's rounding. We check (a) that splitting over compnodes adds nothing (2 and 3 pieces equal 1
  piece bit for bit) and (b) last-batch gradients (task grad: no optimizer amplifying noise) within
  ``8 * eps(dtype) * max|g|`` per tensor, losses within ``8 * eps(dtype)`` relative. 8 eps: a gradient
  is a sum of products rounded once in the compute dtype per micro-batch and once more when cast to
  fp32; the measured worst case on these jobs is ~2 eps.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import load_file

from fusionnet.broker.checkpoints import Checkpoint
from fusionnet.compnode.netchannel import NetChannel
from fusionnet.compnode.value_frames import check_against_meta
from fusionnet.dag.channel import LocalHub
from fusionnet.dag.precision import LossScaler, autocast
from fusionnet.errors import JobError, WireError
from fusionnet.job.loader import load_job
from fusionnet.job.parse import parse_yaml_text, spec_from_document
from fusionnet.messages.jobwire import RunSpec
from fusionnet.reference import run_reference
from fusionnet.runtime.local import InMemorySwarm, run_local
from fusionnet.runtime.prepare import prepare_job, trace_job
from fusionnet.wire.frames import TensorFrame
from tests.dag_models import token_data
from tests.jobfiles import REPO, example_job, write_job
from tests.wire_support import frame_bytes, read_bytes

EPS = {"bf16": torch.finfo(torch.bfloat16).eps, "fp16": torch.finfo(torch.float16).eps}
# examples/gpt takes 20-50 s per case on 2 shared cores: it runs in the slow tier.
EXAMPLES = ["mlp", "figure3", pytest.param("gpt", marks=pytest.mark.slow)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _set_precision(path: Path, precision: str | None, **keys: Any) -> Path:
    doc = yaml.safe_load(path.read_text())
    if precision is not None:
        doc["precision"] = precision
    doc.update(keys)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _assert_equal(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k


def _assert_close(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], eps: float) -> None:
    assert sorted(got) == sorted(want)
    for k, w in want.items():
        bound = 8 * eps * float(w.abs().max()) + 1e-12
        diff = float((got[k].double() - w.double()).abs().max())
        assert diff <= bound, f"{k}: {diff:.3g} > {bound:.3g}"


def parse_job_text(text: str) -> Any:
    return spec_from_document(parse_yaml_text(text, "job.yaml"), "job.yaml")


def _losses(result: Any) -> list[float]:
    return [row["loss"] for row in result.metrics]


# -- the job key and the wire ------------------------------------------------------------------------
def test_job_key_defaults_to_fp32_and_refuses_others() -> None:
    text = (REPO / "examples" / "mlp" / "job.yaml").read_text()
    assert parse_job_text(text).precision == "fp32"
    assert parse_job_text(text + "precision: bf16\n").precision == "bf16"
    with pytest.raises(JobError, match="precision"):
        parse_job_text(text + "precision: fp8\n")
    base = {"name": "j", "task": "infer", "batch_size": 2, "microbatches": 1, "steps": 1}
    base |= {"n_samples": 4, "compnodes": 1}
    assert RunSpec.parse(base).precision == "fp32"  # an older peer's run spec
    assert RunSpec.parse(base | {"precision": "fp16"}).precision == "fp16"
    with pytest.raises(JobError):
        RunSpec.parse(base | {"precision": "fp64"})


def test_received_tensors_may_be_in_the_compute_dtype_only() -> None:
    meta = {"shape": [4, 8], "dtype": "float32"}
    value = torch.zeros(2, 8, dtype=torch.bfloat16)
    check_against_meta(value, meta, 4, "act x", torch.bfloat16)
    with pytest.raises(WireError, match="dtype"):
        check_against_meta(value, meta, 4, "act x")  # an fp32 job
    with pytest.raises(WireError, match="dtype"):
        check_against_meta(value.half(), meta, 4, "act x", torch.bfloat16)
    with pytest.raises(WireError, match="dtype"):  # only float32 values of the IR may be autocast
        check_against_meta(value, {"shape": [4, 8], "dtype": "int64"}, 4, "act x", torch.bfloat16)


def test_loss_scaler_equals_torch_grad_scaler() -> None:
    torch.manual_seed(0)
    theirs = torch.amp.GradScaler("cpu", growth_interval=3)
    ours = LossScaler(growth_interval=3)
    for i in range(12):
        g = torch.randn(5)
        if i in (2, 7, 8):
            g[0] = float("inf") if i != 8 else float("nan")
        p = torch.nn.Parameter(torch.zeros(5))
        opt = torch.optim.SGD([p], lr=0.1)
        p.grad = g * theirs.scale(torch.ones(()))
        theirs.unscale_(opt)
        their_found = bool(sum(v.item() for v in theirs._found_inf_per_device(opt).values()))
        their_grad = p.grad.clone()
        theirs.step(opt)
        theirs.update()
        mine = [g * ours.scale]
        found = ours.unscale_(mine)
        ours.update(found)
        assert found == their_found
        assert found or torch.equal(mine[0], their_grad)
        assert float(ours.scale) == theirs.get_scale()


def test_checkpoint_slices_carry_the_loss_scale() -> None:
    scaler = LossScaler()
    scaler.update(True)
    ckpt = Checkpoint(
        1, {"a": torch.zeros(1), "b": torch.zeros(1)}, {"opt::a::m": torch.ones(1)} | scaler.state()
    )
    _state, optim = ckpt.for_subdag(["b"], [])
    fresh = LossScaler()
    fresh.load_state(optim)
    assert float(fresh.scale) == 2.0**15 and "opt::a::m" not in optim


# -- run --local against the reference -------------------------------------------------------------
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_bit_exact_with_one_microbatch(example: str, precision: str, tmp_path: Path) -> None:
    path = example_job(example, tmp_path, precision=precision, microbatches=1, steps=3)
    try:
        job = load_job(path)
        ref = run_reference(job)
        for pieces in (1, 2, 3):
            got = run_local(job, pieces)
            _assert_equal(got.weights, ref.weights)
            assert _losses(got) == ref.losses, pieces
    finally:
        path.unlink()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
@pytest.mark.parametrize("example", EXAMPLES)
def test_examples_microbatched_equal_to_rounding(example: str, precision: str, tmp_path: Path) -> None:
    path = example_job(example, tmp_path, precision=precision, microbatches=2, steps=2, task="grad")
    try:
        job = load_job(path)
        ref = run_reference(job)
        one = run_local(job, 1)
        # A parameter read across a cut (a tied embedding) sums its far side's gradients over the step
        # before they join its own (it crosses once per step): equal to fp32 accumulation's rounding.
        shared = {n.target for n in trace_job(job).graph.nodes if n.kind == "variable"}
        for pieces in (2, 3):  # distribution adds nothing to micro-batching
            got = run_local(job, pieces)
            _assert_equal({k: v for k, v in got.grads.items() if k not in shared},
                          {k: v for k, v in one.grads.items() if k not in shared})  # fmt: skip
            _assert_close({k: got.grads[k] for k in shared}, {k: one.grads[k] for k in shared},
                          torch.finfo(torch.float32).eps)  # fmt: skip
            assert _losses(got) == _losses(one)
        _assert_close(one.grads, ref.grads, EPS[precision])
        for a, b in zip(_losses(one), ref.losses):
            assert abs(a - b) <= 8 * EPS[precision] * abs(b)
    finally:
        path.unlink()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_infer_outputs_in_the_compute_dtype(precision: str, tmp_path: Path) -> None:
    path = example_job("figure3", tmp_path, precision=precision, task="infer")
    try:
        job = load_job(path)
        ref, got = run_reference(job), run_local(job, 3)
    finally:
        path.unlink()
    assert ref.outputs is not None and ref.outputs.dtype == DTYPES[precision]
    assert got.outputs is not None and got.outputs.dtype == ref.outputs.dtype
    assert torch.equal(got.outputs, ref.outputs)


@pytest.mark.timeout(600)
def test_fp32_unchanged_bit_for_bit(tmp_path: Path) -> None:
    implicit = example_job("mlp", tmp_path / "a", steps=3)
    explicit = example_job("mlp", tmp_path / "b", steps=3, precision="fp32")
    try:
        a, b = run_local(load_job(implicit), 2), run_local(load_job(explicit), 2)
        _assert_equal(a.weights, b.weights)
        assert _losses(a) == _losses(b)
    finally:
        implicit.unlink()
        explicit.unlink()


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_transformers_gpt2_equals_reference(precision: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    ids, labels = token_data(16)
    path = write_job(
        tmp_path / "job", model_class="HFCausalLM", inputs=ids, labels=labels, loss=False,
        microbatches=1, steps=2, compnodes=2,
    )  # fmt: skip
    job = load_job(_set_precision(path, precision))
    ref = run_reference(job)
    for pieces in (2, 3):
        got = run_local(job, pieces)
        _assert_equal(got.weights, ref.weights)
        assert _losses(got) == ref.losses
    grad_path = write_job(
        tmp_path / "grad", model_class="HFCausalLM", inputs=ids, labels=labels, loss=False,
        microbatches=2, steps=1, compnodes=2, task="grad",
    )  # fmt: skip
    grad = load_job(_set_precision(grad_path, precision))
    ref_grads, got = run_reference(grad), run_local(grad, 2)
    _assert_close(got.grads, ref_grads.grads, EPS[precision])


def _overflowing_fp16_job(directory: Path, steps: int) -> Path:
    """An fp16 job whose first steps overflow (checked: one step leaves the weights as they were)."""
    g = torch.Generator().manual_seed(0)
    inputs, labels = torch.randn(16, 12, generator=g), 1e3 * torch.randn(16, 3, generator=g)
    path = write_job(
        directory, model_class="SkipEverywhere", inputs=inputs, labels=labels,
        loss={"name": "mse_loss", "kwargs": {"reduction": "sum"}}, optimizer={"name": "sgd", "lr": 1e-6},
        microbatches=1, batch_size=16, steps=1, compnodes=2,
    )  # fmt: skip
    one = load_job(_set_precision(path, "fp16"))
    initial = one.model.state_dict()
    assert all(torch.equal(v, initial[k]) for k, v in run_reference(one).weights.items()), "no overflow"
    return _set_precision(path, "fp16", steps=steps)


@pytest.mark.timeout(600)
def test_fp16_overflow_skips_every_subdag_together(tmp_path: Path) -> None:
    """Targets of size 1e3 under a summed MSE overflow fp16 gradients at the initial scale 2**16: the
    scaler must back off and skip the step on every sub-DAG at once, as the single-process one does."""
    path = _overflowing_fp16_job(tmp_path / "job", steps=10)
    job = load_job(path)
    ref = run_reference(job)
    for pieces in (2, 3):
        got = run_local(job, pieces)
        _assert_equal(got.weights, ref.weights)
        assert _losses(got) == ref.losses


# -- what travels ------------------------------------------------------------------------------------
class _RecordingHub(LocalHub):
    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.sent: list[tuple[str, str, torch.dtype]] = []

    def channel(self, index: int) -> Any:
        inner = super().channel(index)
        hub = self

        class _Recording(type(inner)):  # type: ignore[misc]
            async def send(self, dst: int, key: Any, value: Any) -> None:
                for leaf in value if isinstance(value, list | tuple) else [value]:
                    if isinstance(leaf, torch.Tensor):
                        hub.sent.append((key[0], key[3], leaf.dtype))
                await super().send(dst, key, value)

        return _Recording(self, index)


@pytest.mark.timeout(300)
def test_activations_and_gradients_travel_in_the_compute_dtype(tmp_path: Path) -> None:
    path = example_job("mlp", tmp_path, precision="bf16", microbatches=1, steps=1)
    try:
        prepared = prepare_job(load_job(path), 2)
    finally:
        path.unlink()
    swarm = InMemorySwarm(prepared)
    hub = _RecordingHub(len(swarm.executors))
    for ex in swarm.executors:
        ex.channel = hub.channel(ex.subdag.index)
    swarm.hub = hub

    async def one_step() -> None:
        for data in swarm.steps(1):
            await swarm.step(data)

    asyncio.run(one_step())
    kinds = {(kind, dtype) for kind, _node, dtype in hub.sent}
    assert ("act", torch.bfloat16) in kinds and ("grad", torch.bfloat16) in kinds, hub.sent
    assert not any(kind == "act" and dtype == torch.float32 for kind, _n, dtype in hub.sent), hub.sent


@pytest.mark.timeout(120)
def test_a_bf16_activation_arrives_as_bf16_frames_and_passes_validation(tmp_path: Path) -> None:
    """The value sub-DAG 0 of a bf16 job sends goes through the real frame codec (bytes) into a
    ``NetChannel`` that validates it against the float32 IR, as a compnode's does."""
    path = example_job("mlp", tmp_path, precision="bf16", microbatches=1, steps=1)
    try:
        prepared = prepare_job(load_job(path), 2)
    finally:
        path.unlink()
    swarm = InMemorySwarm(prepared)
    graph, first = prepared.traced.graph, swarm.executors[0]
    name = first.subdag.outwards[0]
    meta = graph.node(name).meta

    async def run() -> tuple[Any, list[torch.dtype]]:
        data = next(iter(swarm.steps(1)))
        inputs = {
            k: v
            for k, v in data.microbatches[0].items()
            if k in {graph.node(p).target for p in first.subdag.placeholders}
        }
        outs = await first.forward(0, 0, inputs)
        value = dict(zip(first.output_names, outs))[name]
        on_wire: list[torch.dtype] = []

        async def send_frame(dst: int, frame: TensorFrame) -> None:
            got = await read_bytes(frame_bytes(frame))
            on_wire.append(got.tensor.dtype)
            receiver.on_frame(got)

        receiver = NetChannel(
            job_id="job1", peer_id="B", subdag_of_peer={"A": 0}, send_frame=send_frame,
            validate=lambda src, key, v: check_against_meta(v, meta, None, "act", torch.bfloat16),
        )  # fmt: skip
        sender = NetChannel(job_id="job1", peer_id="A", subdag_of_peer={}, send_frame=send_frame)
        await sender.send(1, ("act", 0, 0, name), value.detach())
        return await asyncio.wait_for(receiver.recv(0, ("act", 0, 0, name)), 10), on_wire

    received, on_wire = asyncio.run(run())
    assert received.dtype == torch.bfloat16 and meta["dtype"] == "float32"
    # a small value travels as one packed frame (uint8 bytes, ``valuepack``) holding the bf16 tensor
    assert on_wire == [torch.uint8]


def test_autocast_is_off_for_fp32() -> None:
    with autocast("fp32"):
        assert not torch.is_autocast_enabled("cpu")
    with autocast("bf16"):
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


# -- the swarm ---------------------------------------------------------------------------------------
@pytest.mark.swarm
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_swarm_bf16_and_fp16_jobs_equal_reference(tmp_path: Path) -> None:
    """A bf16 example and an fp16 job that overflows (steps skipped on both compnodes together, agreed
    over the network) equal plain PyTorch under the same autocast, bit for bit."""
    from fusionnet.runtime.process_swarm import BlockingObserver, running_swarm

    bf16 = example_job("mlp", tmp_path, precision="bf16", steps=3, microbatches=1)
    try:
        jobs = {"bf16": bf16, "fp16": _overflowing_fp16_job(tmp_path / "fp16", steps=6)}
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the compnodes compute (OMP_NUM_THREADS=1): the same reductions
        try:
            refs = {k: run_reference(load_job(p)) for k, p in jobs.items()}
        finally:
            torch.set_num_threads(threads)
        with running_swarm(tmp_path / "swarm", [{}, {}]) as sw:
            observer = BlockingObserver(sw.initial_peers)
            try:
                observer.wait_online(2, 120)
                for name, path in jobs.items():
                    cmd = [
                        sys.executable, "-m", "fusionnet.cli.main", "submit", str(path),
                        "--initial-peers", *sw.initial_peers, "--output", str(tmp_path / name),
                        "--timeout", "240",
                    ]  # fmt: skip
                    env = {**os.environ, "OMP_NUM_THREADS": "1"}
                    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=300, env=env)
                    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}\n{sw.dump_logs()[-6000:]}"
            finally:
                observer.close()
    finally:
        bf16.unlink()
    for name, ref in refs.items():
        _assert_equal(load_file(tmp_path / name / "weights.safetensors"), ref.weights)
