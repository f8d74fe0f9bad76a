"""The executor calibration (``profiling.calibration``): its synthetic models run through the real
executor and cover what the performance model prices; its result is cached per machine and base."""

from __future__ import annotations

import asyncio

import pytest
import torch

from fusionnet.perfmodel.types import OP_CLASSES, ClassCost, DeviceSpec, Overheads
from fusionnet.profiling import calibration
from fusionnet.profiling.calibration_models import CALIBRATION_MODELS
from tests.planning_support import fitting_device

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def samples() -> list:
    torch.set_num_threads(1)
    return calibration.measure_stage_samples(0.05)


def test_every_model_split_every_way_yields_one_sample_per_sub_dag(samples) -> None:
    assert len(samples) == len(CALIBRATION_MODELS) * sum(calibration.SPLITS)
    for s in samples:
        assert s.fp > 0 and s.microbatches >= 1
        assert (s.bp > 0) == s.has_backward
        assert s.update > 0 or not s.has_update


def test_samples_cover_every_priced_op_class_optimizer_and_first_layers(samples) -> None:
    classes = {op.op_class for s in samples for op in s.ops}
    assert classes >= set(OP_CLASSES) - {"other"}
    optimizers = {op.optimizer for s in samples for op in s.ops if op.param_bytes}
    assert optimizers >= {"sgd", "sgd_momentum", "adam", "adamw", "rmsprop"}
    first = {op.op_class for s in samples for op in s.ops if op.param_bytes and not op.input_grad}
    assert first >= {"matmul", "conv"}


def base_device(stage_fp: float) -> DeviceSpec:
    return fitting_device(Overheads(matmul=ClassCost(fp=5e-6, bp=9e-6, efficiency=0.9), stage_fp=stage_fp))


def test_calibrated_overheads_are_cached_per_base(tmp_path, monkeypatch, samples) -> None:
    calls = []

    def fake_calibrate(device: DeviceSpec, seconds_budget: float = 1.0) -> Overheads:
        calls.append(device.overheads.stage_fp)
        return calibration.fit_overheads(samples, device)

    monkeypatch.setattr(calibration, "calibrate_overheads", fake_calibrate)
    first = calibration.calibrated_overheads(base_device(2e-6), 0.1, tmp_path)
    assert calibration.calibrated_overheads(base_device(2e-6), 0.1, tmp_path) == first
    assert calls == [2e-6]
    calibration.calibrated_overheads(base_device(3e-6), 0.1, tmp_path)  # another base: measured again
    assert calls == [2e-6, 3e-6]
    # an unreadable cache is measured again and overwritten, never trusted
    for path in tmp_path.glob("calibration-*.json"):
        path.write_text("{not json")
    assert calibration.calibrated_overheads(base_device(2e-6), 0.1, tmp_path) == first
    assert calls == [2e-6, 3e-6, 2e-6]


@pytest.mark.timeout(60)
def test_a_stopping_daemon_stops_a_calibration_in_progress() -> None:
    """A compnode told to stop mid-calibration must not live on until the calibration ends (the
    interpreter joins the compute thread at exit): the next step raises, and nothing is returned."""
    calibration.stop_calibrating()
    try:
        with pytest.raises(calibration.CalibrationStopped, match="shutting down"):
            calibration.measure_stage_samples(seconds_budget=30.0)
    finally:
        calibration._STOP.clear()
    assert len(calibration.measure_stage_samples(seconds_budget=0.05)) > 0  # cleared: measures again


@pytest.mark.timeout(60)
def test_a_calibration_gives_way_to_a_job_and_runs_again_when_allowed() -> None:
    calibration.yield_to_work()
    try:
        with pytest.raises(calibration.CalibrationYielded, match="gave way to a job"):
            calibration.measure_stage_samples(seconds_budget=30.0)
    finally:
        calibration.allow_calibrating()
    assert len(calibration.measure_stage_samples(seconds_budget=0.05)) > 0


@pytest.mark.timeout(60)
def test_the_compnode_calibrates_again_once_idle_after_giving_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CompnodeDaemon._calibrated`` on a stand-in daemon: the first calibration gives way to a job, the
    second starts only after the node held no job for ``CALIBRATION_IDLE`` and its result is announced."""
    from fusionnet.compnode import daemon as compnode_daemon

    monkeypatch.setattr(compnode_daemon, "CALIBRATION_IDLE", 0.3)
    monkeypatch.setattr(compnode_daemon, "IDLE_POLL", 0.05)
    events: list[str] = []

    class StandIn:
        held = 1  # jobs held
        polls = 0  # how often the idle wait looked
        _calibrating = True
        calibrated = asyncio.Event()  # what the sandbox warm-up waits for

        @property
        def running_tasks(self) -> int:
            self.polls += 1
            return self.held

        _until_idle = compnode_daemon.CompnodeDaemon._until_idle

        def _start_calibration(self, hardware: str) -> asyncio.Future[str]:
            events.append(f"start after {self.running_tasks} running")
            done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
            done.set_result(f"{hardware}+overheads")
            return done

        def _set_hardware(self, hardware: str) -> None:
            events.append(f"set {hardware}")

        async def announce_now(self) -> None:
            events.append("announced")

    async def scenario() -> None:
        node = StandIn()
        yielded: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        yielded.set_exception(calibration.CalibrationYielded("calibration gave way to a job"))
        calibrated = compnode_daemon.CompnodeDaemon._calibrated(node, "hw", yielded)  # type: ignore[arg-type]
        task = asyncio.ensure_future(calibrated)

        async def looked(times: int) -> None:
            while node.polls < times:
                await asyncio.sleep(0.01)

        # twice the idle time in polls: had it not waited for the job, it would have run by then
        await asyncio.wait_for(looked(2 * round(0.3 / 0.05)), 10)
        assert events == [] and not node._calibrating  # a job is held: no new calibration
        node.held = 0
        await asyncio.wait_for(task, 5)
        assert events == ["start after 0 running", "set hw+overheads", "announced"]

    asyncio.run(scenario())
