"""Executor calibration: the device's fixed costs as the executor pays them.

``microbench`` times every op class in a loop of its own; in the executor an op runs cold, between
other ops, other sub-DAGs, the channel and the event loop, and on small models that is most of the
time (see ``perfmodel.overhead_fit``). Here the synthetic models of ``calibration_models`` are
traced, split 1..3 ways and stepped through the real ``SubDagExecutor`` over an in-memory hub
(``dag.channel.LocalHub``), all of them in turn (so each step runs after other models' work, as a
compnode's sub-tasks do); the fastest FP, BP and Update of each sub-DAG over the steps, with the
sub-DAG's ops, go to ``fit_overheads``. The result replaces the micro-benchmarks' fixed costs (their
efficiencies stay).

``local_device_spec`` (this machine as a ``DeviceSpec``) and the compnode's announced overheads both
come from here; results are cached per machine next to the hardware profile.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fusionnet.dag.channel import LocalHub
from fusionnet.dag.executor import SubDagExecutor
from fusionnet.dag.partition import balanced_assignment, build_partition
from fusionnet.dag.trace import trace_model
from fusionnet.job.losses import make_loss_fn
from fusionnet.job.optim import ResolvedOptim, build_optimizers, canonical_name
from fusionnet.perfmodel.overhead_fit import StageSample, fit_overheads
from fusionnet.perfmodel.types import DeviceSpec, Overheads
from fusionnet.planning.costgraph import cost_graph
from fusionnet.planning.optimizers import optimizer_profile_name
from fusionnet.profiling.calibration_models import CALIBRATION_MODELS, CalibrationModel
from fusionnet.profiling.hardware import (
    _default_cache_dir,
    cached_measurement,
    machine_key,
    profile_local_device,
)
from fusionnet.profiling.microbench import profile_overheads

CALIBRATION_VERSION = 1
SPLITS = (1, 2, 3)  # every model is run whole and cut 2 and 3 ways: stage counts and op mixes vary
WARMUP = 3  # steps before timing: lazy initialisation (optimizer state, allocator pools)
MIN_STEPS, MAX_STEPS = 8, 80
BATCHES = 4  # distinct batches per model, cycled
SEED = 1234


class _Traced:
    """One calibration model traced once, with its batches, optimizer setting and cost graph."""

    def __init__(self, model: CalibrationModel, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            module = model.build()
        m = model.microbatches
        size = model.batch_size // m
        self.batches = []
        for _ in range(BATCHES):
            inputs, labels = model.data(gen, model.batch_size)
            mbs = [
                {"inputs": inputs[i * size : (i + 1) * size], "labels": labels[i * size : (i + 1) * size]}
                for i in range(m)
            ]
            self.batches.append((mbs, [size] * m))
        first = self.batches[0][0][0]
        self.traced = trace_model(
            module, first["inputs"], first["labels"], make_loss_fn("cross_entropy", {}), "train"
        )
        self.setting = ResolvedOptim(canonical_name(model.optimizer), 1e-3, dict(model.optimizer_kwargs))
        profile = optimizer_profile_name(self.setting.cls_name, self.setting.kwargs)
        self.costs = cost_graph(self.traced.graph, {k: profile for k in self.traced.graph.params})
        self.microbatches = m


class _Split:
    """One traced calibration model cut ``pieces`` ways: its executors and its fastest timings."""

    def __init__(self, model: _Traced, pieces: int) -> None:
        graph, cg = model.traced.graph, model.costs
        partition = build_partition(graph, balanced_assignment(graph, pieces))
        setting = model.setting
        # The executors over an in-memory hub, as ``fusionnet run --local`` steps them (without its
        # job-file plumbing: these models have no job file).
        self.hub = LocalHub(len(partition.subdags))
        self.executors = [
            SubDagExecutor(
                graph,
                s,
                model.traced.state,  # every executor copies the parameters it owns
                self.hub.channel(s.index),
                task="train",
                make_optimizers=lambda named: build_optimizers(named, {k: setting for k in named}),
                subdags=len(partition.subdags),
            )
            for s in partition.subdags
        ]
        # the dataset fields each sub-DAG's placeholders read (labels go where the loss is)
        self.fields = [{graph.node(p).target for p in s.placeholders} for s in partition.subdags]
        self.stages = []
        for s in partition.subdags:
            idx = [i for i, op in enumerate(cg.ops) if partition.assignment[op.name] == s.index]
            self.stages.append((tuple(cg.ops[i] for i in idx), tuple(cg.needs_grad[i] for i in idx)))
        self.batches = model.batches
        self.microbatches = model.microbatches
        self.best: list[list[float]] = [[float("inf")] * 3 for _ in self.stages]
        self.steps = 0

    async def step(self) -> None:
        mbs, sizes = self.batches[self.steps % BATCHES]
        step = self.steps
        reports = await asyncio.gather(
            *(
                ex.run_step(step, [{k: v for k, v in mb.items() if k in wanted} for mb in mbs], sizes)
                for ex, wanted in zip(self.executors, self.fields)
            )
        )
        for ex in self.executors:
            self.hub.mailboxes[ex.subdag.index].forget_step(step)
        self.steps += 1
        if self.steps <= WARMUP:
            return
        for best, r in zip(self.best, reports):
            for i, value in enumerate((r.fp_seconds, r.bp_seconds, r.update_seconds)):
                best[i] = min(best[i], value)

    def samples(self) -> list[StageSample]:
        return [
            StageSample(ops, grads, self.microbatches, *best)
            for (ops, grads), best in zip(self.stages, self.best)
            if all(v < float("inf") for v in best)
        ]


# Set once a daemon is stopping: a calibration running on its compute thread then gives up at its next
# step. The interpreter joins that thread at exit, so without this a compnode told to stop during a
# first start-up's calibration lived on for its remaining seconds (tens on a loaded machine), past the
# lifetime of the OFFLINE record it had just announced.
_STOP = threading.Event()
# Set while a job wants the compute thread the calibration runs on: a compnode that went ONLINE must take
# its first assignment at once, not after tens of seconds of calibration (on a loaded machine), and the
# job's compute must not skew the timings either. The daemon calibrates again once it is idle.
_YIELD = threading.Event()


class CalibrationStopped(RuntimeError):
    pass


class CalibrationYielded(CalibrationStopped):
    """The calibration gave way to a job (``yield_to_work``); worth running again later."""


def stop_calibrating() -> None:
    """Makes every calibration in progress in this process end at its next step (it raises
    ``CalibrationStopped``; nothing is cached)."""
    _STOP.set()


def yield_to_work() -> None:
    """Makes a calibration in progress end at its next step with ``CalibrationYielded`` (nothing is
    cached), and any started before ``allow_calibrating``."""
    _YIELD.set()


def allow_calibrating() -> None:
    _YIELD.clear()


async def _run(splits: list[_Split], seconds: float) -> None:
    deadline = time.perf_counter() + seconds
    for n in range(MAX_STEPS + WARMUP):
        if _STOP.is_set():
            raise CalibrationStopped("calibration stopped: the daemon is shutting down")
        if _YIELD.is_set():
            raise CalibrationYielded("calibration gave way to a job")
        if n >= MIN_STEPS + WARMUP and time.perf_counter() > deadline:
            break
        for split in splits:
            await split.step()


def measure_stage_samples(seconds_budget: float = 1.0) -> list[StageSample]:
    """Every calibration model, split every way of ``SPLITS``, stepped in turn for about
    ``seconds_budget`` seconds (at least ``MIN_STEPS`` timed steps each)."""
    models = [_Traced(model, SEED + i) for i, model in enumerate(CALIBRATION_MODELS)]
    splits = [_Split(model, pieces) for model in models for pieces in SPLITS]
    asyncio.run(_run(splits, seconds_budget))
    return [sample for split in splits for sample in split.samples()]


def calibrate_overheads(device: DeviceSpec, seconds_budget: float = 1.0) -> Overheads:
    """``device``'s overheads with the fixed costs refitted to executor runs (module docstring)."""
    return fit_overheads(measure_stage_samples(seconds_budget), device)


def calibrated_overheads(
    device: DeviceSpec,
    seconds_budget: float = 1.0,
    cache_dir: str | Path | None = None,
    *,
    refresh: bool = False,
) -> Overheads:
    """``calibrate_overheads``, cached per machine and per micro-benchmark result it refines."""
    key: dict[str, Any] = {
        **machine_key(torch.get_num_threads(), torch.__version__),
        "what": "executor calibration",
        "version": CALIBRATION_VERSION,
        "speed": round(float(device.speed), 3),
        "mem_bandwidth": round(float(device.mem_bandwidth), 3),
        "base": device.overheads.to_dict(),
    }
    return cached_measurement(
        cache_dir,
        "calibration",
        key,
        lambda: calibrate_overheads(device, seconds_budget),
        Overheads.to_dict,
        Overheads.from_dict,
        refresh=refresh,
    )


def _cache_dir(cache_dir: str | Path | None) -> Path:
    if cache_dir is not None:
        return Path(cache_dir)
    folder = _default_cache_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        if os.access(folder, os.W_OK):
            return folder
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / "fusionnet-profile"


def local_device_spec(
    name: str = "local", *, seconds_budget: float = 1.0, cache_dir: str | Path | None = None
) -> DeviceSpec:
    """This machine as a ``DeviceSpec``: speed and bandwidth from ``profile_local_device``, fixed costs
    from the micro-benchmarks refined by the executor calibration (all cached per machine, so only the
    first call pays a few seconds), RAM and free disk as its memories."""
    folder = _cache_dir(cache_dir)
    prof = profile_local_device(seconds_budget, folder)
    base = profile_overheads(
        prof.peak_flops * prof.speed_factor, prof.mem_bandwidth, 2 * seconds_budget, folder
    )
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 8 << 30
    disk = shutil.disk_usage(folder if folder.exists() else Path.home()).free
    device = DeviceSpec(
        name=name,
        kind="cpu",
        peak_flops=prof.peak_flops,
        speed_factor=prof.speed_factor,
        mem_bandwidth=prof.mem_bandwidth,
        d_gpu=0,
        d_cpu=int(ram),
        d_disk=int(disk),
        overheads=base,
    )
    return replace(device, overheads=calibrated_overheads(device, seconds_budget, folder))
