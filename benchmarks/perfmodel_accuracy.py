"""Performance-model accuracy on this CPU: predicted vs measured FP+BP+Update seconds per sub-DAG.

Every example job (examples/mlp, examples/figure3, examples/gpt) is split 1..4 ways with the default
balanced policy and run on that many virtual compnodes (``fusionnet run --local``'s executors); each
sub-DAG's measured FP+BP+Update seconds per step is compared with the model's prediction for it.

- The device: this machine, profiled at the start of the run (``profile_local_device`` and
  ``profile_overheads``: matmul speed, memory bandwidth, fixed per-op / per-call costs per op class;
  micro-benchmarks that are none of the jobs below).
- Lambda: the machine's speed drifts (it is shared: a co-tenant on the other hyperthread halves it
  for seconds at a time), so the device's speed factor is fitted for each configuration on a
  separate calibration job (a small conv + MLP model that is none of the examples) whose steps run
  interleaved with the measured job's (``fit_speed_factor`` over its sub-DAGs; ``DeviceSpec.scaled``
  applies it). The measured job's own timings are never used to fit anything.
- Statistic: a sub-DAG's seconds per step is the fastest of ``--steps`` steps after ``WARMUP``
  (timeit's rule: other processes only ever slow a step down). The median-step figures are printed
  too.
- One torch thread: with two, the OpenMP barrier of a matmul waits for a thread a co-tenant has
  descheduled and single steps take 10x longer, which no model of this machine predicts.

Prints a table and a final JSON line with ``median_rel_error`` and ``p90_rel_error`` (fitted lambda),
the profile-only figures beside them, and the median-step figures.

    python benchmarks/perfmodel_accuracy.py [--steps 60] [--pieces 4] [--profile-seconds 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors.torch import save_file

from fusionnet.job.loader import load_job
from fusionnet.perfmodel.fitting import fit_speed_factor
from fusionnet.perfmodel.types import DeviceSpec
from fusionnet.runtime.local import LocalSwarm
from fusionnet.runtime.planning import job_optimizers, local_device_spec, predict_subdags
from fusionnet.runtime.prepare import PreparedJob, prepare_job, trace_job

REPO = Path(__file__).resolve().parent.parent
EXAMPLES = ("mlp", "figure3", "gpt")
WARMUP = 3

CALIBRATION_MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn


class Calibration(nn.Module):
    """Conv, matmuls, norms and elementwise ops in proportions unlike any example's."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1)
        self.fc1 = nn.Linear(4 * 6 * 6, 96)
        self.norm = nn.LayerNorm(96)
        self.fc2 = nn.Linear(96, 48)
        self.fc3 = nn.Linear(48, 5)

    def forward(self, x):
        h = torch.tanh(self.conv(x)).flatten(1)
        h = self.norm(F.silu(self.fc1(h)))
        h = torch.sigmoid(self.fc2(h)) * 2.0 - 1.0
        return self.fc3(h)


def build():
    return Calibration()
'''


def calibration_job(folder: Path) -> Path:
    g = torch.Generator().manual_seed(7)
    inputs = torch.randn(64, 2, 6, 6, generator=g)
    labels = torch.randint(0, 5, (64,), generator=g)
    save_file({"inputs": inputs, "labels": labels}, str(folder / "data.safetensors"))
    (folder / "model.py").write_text(CALIBRATION_MODEL)
    doc = {
        "name": "calibration",
        "task": "train",
        "model": {"entrypoint": "model.py:build"},
        "loss": {"name": "cross_entropy"},
        "data": {"path": "data.safetensors", "batch_size": 16, "microbatches": 2},
        "optimizer": {"name": "rmsprop", "lr": 0.001},
        "steps": 1,
        "placement": {"compnodes": 2},
    }
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def predict(prepared: PreparedJob, device: DeviceSpec) -> dict[int, float]:
    job, graph = prepared.job, prepared.traced.graph
    return predict_subdags(
        graph,
        prepared.partition,
        [device],
        microbatches=job.spec.data.microbatches,
        optimizer=job_optimizers(job, graph),
    )


async def interleaved(target: LocalSwarm, calib: LocalSwarm, steps: int) -> tuple[list, list]:
    """Per step: one calibration step, then one measured step. Returns per-step totals per sub-DAG."""
    t_data, c_data = target.steps(steps), calib.steps(steps)
    t_rows, c_rows = [], []
    for s in range(steps):
        reports = await calib.step(c_data[s])
        c_rows.append([r.fp_seconds + r.bp_seconds + r.update_seconds for r in reports])
        reports = await target.step(t_data[s])
        t_rows.append([r.fp_seconds + r.bp_seconds + r.update_seconds for r in reports])
    return t_rows[WARMUP:], c_rows[WARMUP:]


def errors_summary(errs: list[float]) -> tuple[float, float]:
    a = np.abs(np.array(errs))
    return float(np.median(a)), float(np.quantile(a, 0.9))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=60, help="measured steps per configuration (default 60)")
    p.add_argument("--pieces", type=int, default=4, help="split every job 1..PIECES ways (default 4)")
    p.add_argument("--profile-seconds", type=float, default=1.0, help="profiling budget (default 1)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        device = local_device_spec(seconds_budget=args.profile_seconds, cache_dir=Path(tmp) / "profile")
        calib_dir = Path(tmp) / "calibration"
        calib_dir.mkdir()
        calib_job = load_job(calibration_job(calib_dir))
        calib_prepared = prepare_job(calib_job, 2)
        calib_pred = predict(calib_prepared, device)
        calib = LocalSwarm(calib_prepared)
        rows = []
        lambdas = []
        for name in EXAMPLES:
            job = load_job(REPO / "examples" / name / "job.yaml")
            traced = trace_job(job)
            for k in range(1, args.pieces + 1):
                prepared = prepare_job(job, k, traced=traced)
                t_rows, c_rows = asyncio.run(interleaved(LocalSwarm(prepared), calib, args.steps + WARMUP))
                c_best = [min(r[i] for r in c_rows) for i in range(len(calib_pred))]
                # lambda relative to the profile: measured = predicted(profile) / lambda
                factor = fit_speed_factor(
                    [(calib_pred[i] * device.speed, c_best[i]) for i in calib_pred], device.speed
                )
                lambdas.append(factor)
                fitted = predict(prepared, device.scaled(factor))
                profile_only = predict(prepared, device)
                for s in prepared.partition.subdags:
                    per_step = [r[s.index] for r in t_rows]
                    rows.append(
                        {
                            "job": name,
                            "pieces": k,
                            "subdag": s.index,
                            "ops": len(s.nodes),
                            "measured": min(per_step),
                            "measured_median": statistics.median(per_step),
                            "predicted": fitted[s.index],
                            "profile_only": profile_only[s.index],
                            "lambda": factor,
                        }
                    )
    print(
        f"{'job':<8} {'k':>2} {'sub':>3} {'nodes':>5} {'measured ms':>11} {'predicted ms':>12} {'error':>7} "
        f"{'profile-only':>12} {'error':>7} {'lambda':>6}"
    )
    for r in rows:
        r["error"] = r["predicted"] / r["measured"] - 1
        r["profile_error"] = r["profile_only"] / r["measured"] - 1
        r["median_step_error"] = r["predicted"] / r["measured_median"] - 1
        print(
            f"{r['job']:<8} {r['pieces']:>2} {r['subdag']:>3} {r['ops']:>5} {r['measured'] * 1e3:>11.3f} "
            f"{r['predicted'] * 1e3:>12.3f} {r['error']:>+7.1%} {r['profile_only'] * 1e3:>12.3f} "
            f"{r['profile_error']:>+7.1%} {r['lambda']:>6.2f}"
        )
    med, p90 = errors_summary([r["error"] for r in rows])
    pmed, pp90 = errors_summary([r["profile_error"] for r in rows])
    mmed, mp90 = errors_summary([r["median_step_error"] for r in rows])
    print(
        f"\n{len(rows)} sub-DAGs: fitted lambda median {med:.1%}, p90 {p90:.1%}; profile only median {pmed:.1%}, "
        f"p90 {pp90:.1%}; against median steps median {mmed:.1%}, p90 {mp90:.1%}"
    )
    result = {
        "median_rel_error": med,
        "p90_rel_error": p90,
        "subdags": len(rows),
        "profile_only_median_rel_error": pmed,
        "profile_only_p90_rel_error": pp90,
        "median_step_median_rel_error": mmed,
        "median_step_p90_rel_error": mp90,
        "lambda_min": min(lambdas),
        "lambda_max": max(lambdas),
        "seconds": time.perf_counter() - started,
    }
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
