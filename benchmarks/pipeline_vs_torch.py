"""FusionNet's pipeline against ``torch.distributed.pipelining`` and plain PyTorch, on one machine.

All contenders train the same model (``benchmarks/pipeline_model.py``: identical pre-norm MLP blocks,
cross-entropy on the last block's output; or, ``--model gpt2``, a ``transformers`` GPT-2 with untied
embeddings and its own causal-LM loss, which torch's stages rebuild from its modules, cut between blocks),
from the same initial weights (built right after ``torch.manual_seed(seed)``), on the same batches (batch s
= samples [s*B, (s+1)*B) modulo the dataset), with the same schedule (``--schedule``: GPipe, each batch
split into M micro-batches, all forwards, all backwards, one SGD step; or 1F1B; or zero-bubble ZB-H1,
FusionNet's ``zero-bubble`` against torch's schedule runtime given the same ZB-H1 programs (torch's own
zero-bubble schedules need several stages per rank); or interleaved 1F1B, the model cut into N x
``--chunks`` stages, torch's rank r and FusionNet's compnode r holding stages r, N + r, ...), and with the
same number of torch threads per process (``--threads``, default 1).
FusionNet's rows also give each stage's peak activation bytes (metrics.jsonl's ``activation_peak_bytes``)
and the bubble: the share of the step its stages did not compute, averaged over the stages (1 -
``compute_seconds`` / ``seconds``; it includes waiting for the network and the broker's call, which the
schedule's own bubble, (p - 1) / (m + p - 1), does not); and "beyond path": the share of the step beyond
its schedule run on its stages' own measured compute with free messages (metrics.jsonl's
``compute_path_seconds``), which is what the network, the runtime's messaging and the broker's call cost
it; the rest of the difference to torch's pipeline is the compute itself):

- ``plain torch``       one process, the M micro-batches one after the other with gradient accumulation.
                        The reference for the ratios.
- ``torch pipe N``      ``torch.distributed.pipelining`` (``PipelineStage`` + ``ScheduleGPipe``, gloo on
                        127.0.0.1), one process per stage, the model cut at the same block boundaries as
                        FusionNet's plan for N compnodes.
- ``fusionnet N``       a real FusionNet swarm on loopback: ``fusionnet broker`` and N ``fusionnet
                        compnode`` daemons (one process each, ``--threads``), the job handed over with
                        ``fusionnet submit``; step times are the ``seconds`` of its ``metrics.jsonl``.
- ``fusionnet local N`` ``fusionnet run --local N``: the same planner and executor in one process (N
                        virtual compnodes, in-memory channel). Shows the executor's own overhead.

Step times are medians over the steps after ``--warmup``. Each torch contender times a step from a barrier
before it to a barrier after the optimizer step (so the slowest stage counts); FusionNet times it in its
driver. By default (``--placement blocks``) FusionNet's job names its cuts (``placement.cuts``) at the
balanced block split. The split of the torch pipeline is read from FusionNet's ``plan.json`` (per sub-DAG
its nodes, mapped to blocks; a cut inside a block is refused, or for GPT-2 moved to the nearest block
boundary and marked so) and printed; without a FusionNet plan the balanced block split is used and marked
as assumed. The first and last losses are printed per contender as a check that they all train the same
thing.

FusionNet's sandbox workers keep freed memory in their heap (``fusionnet.daemon.memory.keep_freed_memory``):
a step's tensors reuse the last step's pages instead of faulting fresh ones in; and they advise huge pages
for tensors of 2 MiB and more (``fusionnet.compnode.sandbox_preload``). The torch contenders run with
glibc's and torch's defaults, as torch's users do; ``--torch-allocator kept`` gives them the same
settings, to show what of a difference is those settings alone.

On a 2-core machine, 3 stages (plus the broker and hivemind's p2pd helpers for FusionNet) oversubscribe
the cores; the ratios then measure that too. Prints a table, then one JSON line.

Several ``--schedule``s run in turn within each round (plain PyTorch once per round), so one schedule's
step is held against another's measured at the same time; a last table sets them side by side.

With ``--repeat`` R, every contender's steps of all rounds make its median, and each FusionNet row also
shows its ratio to torch's pipeline round by round ("rounds", paired in time), the median of those
("rounds median": the run's ratio, the figure the README quotes; on a shared machine whose speed moves
between rounds the pooled medians can land between two clusters of steps, ``paired_ratio.py``) and a 95 %
bootstrap interval of the pooled ratio that resamples each round's steps on its own: one run's ratio moves
by several percent, and these say by how much.

    python benchmarks/pipeline_vs_torch.py [--schedule gpipe 1f1b zero-bubble] [--steps 20]
        [--microbatches 4] [--stages 2 3] [--model mlp|gpt2] [--placement blocks|model|balanced]
        [--repeat 3] [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from paired_ratio import fmt_interval, fmt_rounds, median_of_rounds, ratio_interval, round_ratios
from pipeline_common import KINDS, Config, Result, balanced_split, format_split, make_data, split_from_plan
from pipeline_fusionnet import run_fusionnet_local, run_fusionnet_swarms
from pipeline_torch import run_plain, run_torchpipe

SCHEDULES = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b")


# ---- report ---------------------------------------------------------------------------------------------
def fmt_ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.1f}"


def fmt_ratio(a: float | None, b: float | None) -> str:
    return "-" if a is None or b is None else f"{a / b:.2f}"


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a / b, 4)


def one_line(error: str) -> str:
    """First and last line of an error (a headline and, for tracebacks and command output, the reason)."""
    lines = [ln.strip() for ln in error.split("\n[")[0].splitlines() if ln.strip()] or ["?"]
    return lines[0] if len(lines) == 1 else f"{lines[0]} ... {lines[-1]}"


def key_of(name: str) -> str:
    return name.replace("plain torch", "plain").replace("torch pipe", "torchpipe").replace(" ", "_")


def report(results: list[Result], cfg: Config, stages: list[int], splits: dict[int, Any]) -> dict[str, Any]:
    order = ["plain torch"] + [f"{kind} {n}" for kind in KINDS for n in stages]
    results = sorted(results, key=lambda r: order.index(r.name) if r.name in order else len(order))
    med = {r.name: r.median(cfg.warmup) for r in results}
    low = {r.name: r.minimum(cfg.warmup) for r in results}
    plain = med.get("plain torch")
    by_name = {r.name: r for r in results}
    rows = [
        ("contender", "step ms", "min ms", "x plain", "x torch pipe N", "rounds", "rounds median",
         "95% interval", "act. MB per stage", "bubble", "beyond path", "loss first", "loss last", "notes")
    ]  # fmt: skip
    for r in results:
        n = r.name.rsplit(" ", 1)[-1]
        pipe = med.get(f"torch pipe {n}") if n.isdigit() and r.name.startswith("fusionnet") else None
        theirs = by_name.get(f"torch pipe {n}") if pipe else None
        paired = theirs is not None and r.error is None and theirs.error is None
        rounds = round_ratios(r.round_times, theirs.round_times) if paired else []
        rounds_median = median_of_rounds(rounds)
        rows.append((
            r.name, fmt_ms(med[r.name]), fmt_ms(low[r.name]),
            fmt_ratio(med[r.name], plain), fmt_ratio(med[r.name], pipe) if pipe else "",
            fmt_rounds(rounds), "" if rounds_median is None else f"{rounds_median:.2f}",
            fmt_interval(ratio_interval(r.round_times, theirs.round_times)) if paired else "",
            "/".join(f"{b / 1e6:.2f}" for b in r.activation_peak) if r.activation_peak else "",
            "" if r.bubble(cfg.warmup) is None else f"{r.bubble(cfg.warmup):.2f}",
            "" if r.beyond(cfg.warmup) is None else f"{r.beyond(cfg.warmup):.3f}",
            f"{r.losses[0]:.5f}" if r.losses else "-", f"{r.losses[-1]:.5f}" if r.losses else "-",
            "FAILED (see below)" if r.error else r.note,
        ))  # fmt: skip
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(rows[0]))]
    print()
    for row in rows:
        print("  ".join(str(v).ljust(w) for v, w in zip(row, widths)).rstrip())
    for r in results:
        if r.error:
            print(f"\n{r.name} failed: {r.error}")

    summary: dict[str, Any] = {"benchmark": "pipeline_vs_torch"}
    for r in results:
        summary[f"{key_of(r.name)}_ms"] = None if med[r.name] is None else round(med[r.name] * 1e3, 3)
    for r in results:
        summary[f"{key_of(r.name)}_min_ms"] = None if low[r.name] is None else round(low[r.name] * 1e3, 3)
    for r in results:  # each round's median: another schedule's rounds pair with these (``side_by_side``)
        if r.error is None and r.round_times:
            summary[f"{key_of(r.name)}_round_ms"] = [
                round(statistics.median(t) * 1e3, 3) if t else None for t in r.round_times
            ]
    for n in stages:
        pipe = med.get(f"torch pipe {n}")
        summary[f"torchpipe_{n}_over_plain"] = ratio(pipe, plain)
        for prefix in ("fusionnet", "fusionnet local"):
            v = med.get(f"{prefix} {n}")
            k = key_of(f"{prefix} {n}")
            summary[f"{k}_over_plain"] = ratio(v, plain)
            summary[f"{k}_over_torchpipe_{n}"] = ratio(v, pipe)
            summary[f"{k}_over_torchpipe_{n}_min"] = ratio(
                low.get(f"{prefix} {n}"), low.get(f"torch pipe {n}")
            )
            ours, theirs = by_name.get(f"{prefix} {n}"), by_name.get(f"torch pipe {n}")
            if ours is not None and theirs is not None and ours.error is None and theirs.error is None:
                rounds = round_ratios(ours.round_times, theirs.round_times)
                summary[f"{k}_over_torchpipe_{n}_rounds"] = [round(x, 4) for x in rounds]
                middle = median_of_rounds(rounds)
                summary[f"{k}_over_torchpipe_{n}_rounds_median"] = (
                    None if middle is None else round(middle, 4)
                )
                interval = ratio_interval(ours.round_times, theirs.round_times)
                summary[f"{k}_over_torchpipe_{n}_interval95"] = (
                    None if interval is None else [round(x, 4) for x in interval]
                )
    for r in results:
        if r.activation_peak:
            summary[f"{key_of(r.name)}_activation_peak_bytes"] = r.activation_peak
        if r.bubble(cfg.warmup) is not None:
            summary[f"{key_of(r.name)}_bubble"] = round(r.bubble(cfg.warmup), 4)
        if r.beyond(cfg.warmup) is not None:
            summary[f"{key_of(r.name)}_beyond_path"] = round(r.beyond(cfg.warmup), 4)
    summary["splits"] = {str(n): format_split(s) for n, (s, _) in splits.items()}
    summary["split_sources"] = {str(n): src for n, (_, src) in splits.items()}
    cfg_d = asdict(cfg)
    cfg_d.pop("data_path")
    summary["config"] = cfg_d
    summary["cpus"] = os.cpu_count()
    reference = next((r.losses for r in results if r.name == "plain torch" and r.losses), None)
    summary["max_loss_diff_vs_plain"] = {
        key_of(r.name): max(abs(a - b) for a, b in zip(r.losses, reference))
        for r in results
        if reference and r.losses and r.name != "plain torch"
    }
    summary["errors"] = {key_of(r.name): one_line(r.error) for r in results if r.error}
    return summary


def describe_model(cfg: Config) -> str:
    size = f"{cfg.layers} blocks, dim {cfg.dim}, hidden {cfg.hidden}"
    if cfg.model == "gpt2":
        return (
            f"transformers GPT-2, {size}, {cfg.heads} heads, vocab {cfg.vocab}, {cfg.seq} tokens per sample"
        )
    return f"MLP {size}"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30, help="training steps per contender (default 30)")
    ap.add_argument("--warmup", type=int, default=5, help="first steps left out of the median (default 5)")
    ap.add_argument("--microbatches", type=int, default=4, help="GPipe micro-batches per batch (default 4)")
    ap.add_argument(
        "--model",
        choices=("mlp", "gpt2"),
        default="mlp",
        help="mlp (default): identical pre-norm MLP blocks; gpt2: a transformers GPT-2 (random init, untied "
        "embeddings, its own causal-LM loss), cut between its blocks",
    )
    ap.add_argument("--batch-size", type=int, help="samples per batch (default: mlp 64, gpt2 8)")
    ap.add_argument("--dim", type=int, help="block width (default: mlp 256, gpt2 512)")
    ap.add_argument("--hidden", type=int, help="MLP width inside a block (default: 4 x --dim)")
    ap.add_argument("--vocab", type=int, default=8000, help="gpt2: token ids (default 8000)")
    ap.add_argument("--seq", type=int, default=64, help="gpt2: tokens per sample (default 64)")
    ap.add_argument("--heads", type=int, default=8, help="gpt2: attention heads (default 8)")
    ap.add_argument("--layers", type=int, default=6, help="blocks (default 6: splits evenly in 2 and 3)")
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3], help="pipeline widths (default 2 3)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads per process, all contenders")
    ap.add_argument(
        "--schedule",
        choices=SCHEDULES,
        nargs="+",
        default=["gpipe"],
        help="pipeline schedule of both pipelines: torch's ScheduleGPipe/Schedule1F1B/"
        "ScheduleInterleaved1F1B and FusionNet's placement.schedule (default gpipe); zero-bubble is "
        "ZB-H1 on both, torch's schedule runtime running FusionNet's programs (torch's own zero-bubble "
        "schedules need several stages per rank); "
        "interleaved-1f1b cuts the model into N x --chunks stages, rank / compnode r holding r, N + r, ...; "
        "several: each round runs them in turn (plain PyTorch once per round), and a last table sets "
        "FusionNet's step per schedule side by side, paired in time",
    )
    ap.add_argument(
        "--sandbox",
        choices=("process", "off"),
        default="process",
        help="the compnodes' --sandbox: each job in a worker process (default) or in the daemon",
    )
    ap.add_argument(
        "--worker-sends",
        choices=("direct", "daemon"),
        default="direct",
        help="the compnodes' --worker-sends: a sandbox worker sends its values over its own TCP (default) "
        "or hands them to its daemon",
    )
    ap.add_argument(
        "--worker-receives",
        choices=("direct", "daemon"),
        default="direct",
        help="the compnodes' --worker-receives: a sandbox worker reads its peers' values itself (default) "
        "or its daemon relays them",
    )
    ap.add_argument(
        "--inline-compute-ms",
        type=float,
        metavar="MS",
        help="the compnodes' --inline-compute-ms: a sandbox worker runs stretches this short on its event "
        "loop (default: theirs; 0: every stretch on the compute thread)",
    )
    ap.add_argument(
        "--placement",
        choices=("model", "balanced", "blocks"),
        default="blocks",
        help="blocks (default): the FusionNet job names its cuts (placement.cuts) at the balanced block "
        "split, the very cut torch's stages run, so both pipelines do the same work per stage; model: the "
        "broker's performance model cuts (where it cuts inside a block the torch pipeline runs the nearest "
        "block boundaries); balanced: the broker's FLOP-balanced split, mirrored the same way",
    )
    ap.add_argument(
        "--replica-interval",
        type=float,
        default=None,
        metavar="SECONDS",
        help="the broker's --replica-interval (default: the broker's own, 2 s): how often FusionNet copies "
        "each stage's state to another compnode for failover, a cost torch's pipeline does not pay",
    )
    ap.add_argument(
        "--chunks",
        type=int,
        default=2,
        help="interleaved-1f1b: stages per torch rank and sub-DAGs per FusionNet compnode (default 2)",
    )
    ap.add_argument(
        "--steps-ahead",
        action="store_true",
        help="the broker's --steps-ahead: each step's call goes out while the step before runs, so no "
        "compnode waits for the broker's round trip between steps",
    )
    ap.add_argument(
        "--torch-allocator",
        choices=("default", "kept"),
        default="default",
        help="the torch contenders' allocator settings: glibc's and torch's defaults (default, what torch's "
        "users get) or 'kept', the settings FusionNet's sandbox workers use (freed tensors stay in the heap "
        "for the next step: no page faults per step; huge pages advised for tensors of 2 MiB and more), to "
        "show what of a difference is those settings alone",
    )
    ap.add_argument("--lr", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run every contender this many times, in turn (default 1); each one's median is over the timed "
        "steps of all its runs, so load that drifts during the run weighs on every contender alike",
    )
    ap.add_argument("--quick", action="store_true", help="8 steps, 2 of them warm-up")
    ap.add_argument("--no-swarm", action="store_true", help="skip the FusionNet swarm runs (a)")
    ap.add_argument("--no-local", action="store_true", help="skip `fusionnet run --local`")
    ap.add_argument("--timeout", type=float, default=240, help="limit per contender, seconds")
    ap.add_argument(
        "--submit-retries", type=int, default=1, help="resubmit a failed FusionNet job this often (default 1)"
    )
    ap.add_argument("--keep", type=Path, metavar="DIR", help="work in DIR and keep it (logs, results)")
    args = ap.parse_args(argv)
    gpt2 = args.model == "gpt2"
    args.batch_size = args.batch_size or (8 if gpt2 else 64)
    args.dim = args.dim or (512 if gpt2 else 256)
    args.hidden = args.hidden or 4 * args.dim
    if gpt2 and args.dim % args.heads:
        ap.error(f"--dim {args.dim} must be a multiple of --heads {args.heads}")
    args.stages = sorted(set(args.stages))
    if args.stages[0] < 2:
        ap.error("--stages: each must be >= 2")
    if args.quick:
        args.steps, args.warmup = 8, 2
    if args.batch_size % args.microbatches:
        ap.error("--batch-size must be a multiple of --microbatches")
    if args.repeat < 1:
        ap.error("--repeat must be at least 1")
    if args.steps <= args.warmup:
        ap.error("--steps must be larger than --warmup")
    return args


def run_contenders(
    cfg: Config, args: argparse.Namespace, workdir: Path, record: Any, plain: bool = True
) -> dict[int, Any]:
    """Every contender in turn (``record`` gets each result; ``plain``: plain PyTorch too, which does not
    depend on the schedule); returns the torch pipeline's split per stage count with where it came from."""
    if plain:
        record(run_plain(cfg, args.timeout))
    plans: dict[int, list[tuple[str, dict[str, Any] | None]]] = {n: [] for n in args.stages}
    if not args.no_local:
        for n in args.stages:
            res, plan = run_fusionnet_local(cfg, n, workdir, args.timeout)
            record(res)
            plans[n].append(("plan of fusionnet local", plan))
    if not args.no_swarm:
        swarms = run_fusionnet_swarms(cfg, args.stages, workdir, args.timeout, args.submit_retries)
        for res, plan in swarms:
            record(res)
            plans[int(res.name.rsplit(" ", 1)[1])].insert(0, ("plan of fusionnet swarm", plan))
    splits: dict[int, tuple[list[tuple[int, int]], str]] = {}
    for n in args.stages:
        split, source = balanced_split(cfg.layers, n * cfg.per_rank), "balanced, assumed"
        # GPT-2: a plan cut inside a block is mirrored as nearly as torch's stages can (``round_cuts``)
        tries = [(what, plan, False) for what, plan in plans[n] if plan is not None]
        if cfg.model == "gpt2":
            tries += [(f"{what}, cuts moved to blocks", plan, True) for what, plan, _ in list(tries)]
        for what, plan, rounded in tries:
            try:
                split, source = split_from_plan(plan, cfg.layers, cfg.model, rounded), what
            except (ValueError, KeyError) as e:
                print(f"  warning: {what}: cannot mirror it: {e}", file=sys.stderr)
                continue
            break
        splits[n] = (split, source)
        record(run_torchpipe(cfg, split, source, args.timeout))
    return splits


def side_by_side(summaries: dict[str, dict[str, Any]], stages: list[int]) -> dict[str, Any]:
    """FusionNet's (and torch's) step per schedule and stage count from each schedule's summary, and each
    schedule's FusionNet step over the first schedule's, run in the same rounds (paired in time)."""
    first = next(iter(summaries))
    out: dict[str, Any] = {}
    for n in stages:
        base = summaries[first].get(f"fusionnet_{n}_ms")
        base_rounds = summaries[first].get(f"fusionnet_{n}_round_ms") or []
        for schedule, summary in summaries.items():
            tag = schedule.replace("-", "_")
            for k in ("fusionnet", "torchpipe"):
                out[f"{k}_{n}_{tag}_ms"] = summary.get(f"{k}_{n}_ms")
            out[f"fusionnet_{n}_{tag}_bubble"] = summary.get(f"fusionnet_{n}_bubble")
            out[f"fusionnet_{n}_{tag}_beyond_path"] = summary.get(f"fusionnet_{n}_beyond_path")
            interval = summary.get(f"fusionnet_{n}_over_torchpipe_{n}_interval95")
            out[f"fusionnet_{n}_{tag}_interval95"] = interval
            out[f"fusionnet_{n}_{tag}_rounds_median"] = summary.get(
                f"fusionnet_{n}_over_torchpipe_{n}_rounds_median"
            )
            if schedule != first:
                v = summary.get(f"fusionnet_{n}_ms")
                out[f"fusionnet_{n}_{tag}_over_{first.replace('-', '_')}"] = ratio(v, base)
                paired = [
                    a / b
                    for a, b in zip(summary.get(f"fusionnet_{n}_round_ms") or [], base_rounds)
                    if a is not None and b  # a round either schedule did not time pairs with nothing
                ]
                middle = median_of_rounds(paired)
                out[f"fusionnet_{n}_{tag}_over_{first.replace('-', '_')}_rounds_median"] = (
                    None if middle is None else round(middle, 4)
                )
    return out


def print_side_by_side(figures: dict[str, Any], schedules: list[str], stages: list[int]) -> None:
    first = schedules[0]
    rows = [("schedule", "stages", "fusionnet ms", "torch pipe ms", "fusionnet / torch pipe", "rounds median",
             "95% interval", f"fusionnet / fusionnet {first}", "rounds median", "bubble",
             "beyond path")]  # fmt: skip
    for n in stages:
        for schedule in schedules:
            tag = schedule.replace("-", "_")
            mine, pipe = figures[f"fusionnet_{n}_{tag}_ms"], figures[f"torchpipe_{n}_{tag}_ms"]
            over = figures.get(f"fusionnet_{n}_{tag}_over_{first.replace('-', '_')}")
            over_rounds = figures.get(f"fusionnet_{n}_{tag}_over_{first.replace('-', '_')}_rounds_median")
            bubble = figures[f"fusionnet_{n}_{tag}_bubble"]
            beyond = figures[f"fusionnet_{n}_{tag}_beyond_path"]
            interval = figures.get(f"fusionnet_{n}_{tag}_interval95")
            middle = figures.get(f"fusionnet_{n}_{tag}_rounds_median")
            rows.append((
                schedule, str(n), fmt_ms(None if mine is None else mine / 1e3),
                fmt_ms(None if pipe is None else pipe / 1e3), fmt_ratio(mine, pipe),
                "" if middle is None else f"{middle:.2f}",
                fmt_interval(None if interval is None else tuple(interval)),
                "" if over is None else f"{over:.2f}", "" if over_rounds is None else f"{over_rounds:.2f}",
                "" if bubble is None else f"{bubble:.2f}",
                "" if beyond is None else f"{beyond:.3f}",
            ))  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    print("\nschedules side by side (the same rounds, in turn):")
    for row in rows:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):  # spawned workers inherit it
        os.environ[var] = str(args.threads)
    loadavg = os.getloadavg()[0]
    t_start = time.monotonic()
    schedules = list(dict.fromkeys(args.schedule))

    with contextlib.ExitStack() as stack:
        if args.keep:
            workdir = args.keep.resolve()
            workdir.mkdir(parents=True, exist_ok=True)
        else:
            workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="pipeline_vs_torch-")))
        base = Config(
            dim=args.dim, hidden=args.hidden, layers=args.layers, batch_size=args.batch_size,
            microbatches=args.microbatches, steps=args.steps, warmup=args.warmup, lr=args.lr,
            seed=args.seed, threads=args.threads, data_path=str(workdir / "data.safetensors"),
            schedule=schedules[0], sandbox=args.sandbox, placement=args.placement,
            worker_sends=args.worker_sends, worker_receives=args.worker_receives,
            inline_compute_ms=args.inline_compute_ms, replica_interval=args.replica_interval,
            steps_ahead=args.steps_ahead, chunks=args.chunks, torch_allocator=args.torch_allocator,
            model=args.model, vocab=args.vocab, seq=args.seq, heads=args.heads,
        )  # fmt: skip
        configs = {schedule: replace(base, schedule=schedule) for schedule in schedules}
        make_data(base, samples=4 * base.batch_size)
        print(
            f"model: {describe_model(base)}; batch {base.batch_size} in "
            f"{base.microbatches} micro-batches, {' then '.join(schedules)}; sandbox {base.sandbox} "
            f"(worker sends {base.worker_sends}, receives {base.worker_receives}, inline compute "
            f"{'default' if base.inline_compute_ms is None else f'{base.inline_compute_ms:g} ms'}); "
            f"placement {base.placement}; replica interval {base.replica_interval or 'default'}; "
            f"steps ahead {'on' if base.steps_ahead else 'off'}; torch allocator {base.torch_allocator}; "
            f"{base.steps} steps ({base.warmup} warm-up); "
            f"{base.threads} thread(s)/process; {os.cpu_count()} CPUs; load {loadavg:.2f}; workdir {workdir}",
            flush=True,
        )
        results: dict[str, list[Result]] = {schedule: [] for schedule in schedules}
        by_name: dict[tuple[str, str], Result] = {}
        splits: dict[str, dict[int, Any]] = {}

        def recorder(schedule: str) -> Any:
            def record(res: Result) -> Result:
                status = "failed" if res.error else f"{fmt_ms(res.median(base.warmup))} ms/step"
                tag = f" [{schedule}]" if len(schedules) > 1 and res.name != "plain torch" else ""
                print(f"  [{time.monotonic() - t_start:5.0f} s] {res.name}{tag}: {status}", flush=True)
                key = ("" if res.name == "plain torch" else schedule, res.name)
                earlier = by_name.get(key)
                if earlier is None:
                    res.round_times.append(res.times[base.warmup :] or res.times)
                    by_name[key] = res
                    for kept in results.values() if res.name == "plain torch" else [results[schedule]]:
                        kept.append(res)  # plain PyTorch: one run per round, the reference of every schedule
                elif res.error is not None:
                    earlier.error = earlier.error or res.error
                else:  # a later round: its timed steps join the first round's (one median over all rounds)
                    earlier.round_times.append(res.times[base.warmup :])
                    earlier.times.extend(res.times[base.warmup :])
                    earlier.bubbles.extend(res.bubbles[base.warmup :])
                    earlier.beyond_path.extend(res.beyond_path[base.warmup :])
                return res

            return record

        for round_ in range(args.repeat):
            if args.repeat > 1:
                print(f"round {round_ + 1} of {args.repeat}", flush=True)
            for i, schedule in enumerate(schedules):
                splits[schedule] = run_contenders(
                    configs[schedule], args, workdir, recorder(schedule), plain=i == 0
                )

    summaries = {}
    for schedule in schedules:
        if len(schedules) > 1:
            print(f"\n== {schedule} ==", end="")
        summary = report(results[schedule], configs[schedule], args.stages, splits[schedule])
        summaries[schedule] = summary
        summary["schedule"] = schedule
    summary = summaries[schedules[0]] if len(schedules) == 1 else {"benchmark": "pipeline_vs_torch"}
    if len(schedules) > 1:
        figures = side_by_side(summaries, args.stages)
        print_side_by_side(figures, schedules, args.stages)
        summary |= figures
        summary["schedules"] = summaries
        summary["errors"] = {f"{s}/{k}": v for s, one in summaries.items() for k, v in one["errors"].items()}
    summary["sandbox"] = base.sandbox
    summary["worker_sends"] = base.worker_sends
    summary["worker_receives"] = base.worker_receives
    summary["inline_compute_ms"] = base.inline_compute_ms
    summary["replica_interval"] = base.replica_interval
    summary["steps_ahead"] = base.steps_ahead
    summary["torch_allocator"] = base.torch_allocator
    summary["model"] = describe_model(base)
    summary["placement"] = base.placement
    summary["repeat"] = args.repeat
    summary["loadavg_before"] = round(loadavg, 2)
    summary["loadavg_after"] = round(os.getloadavg()[0], 2)
    summary["wall_s"] = round(time.monotonic() - t_start, 1)
    print(json.dumps(summary))
    return 0 if not summary["errors"] else 1


if __name__ == "__main__":
    sys.exit(main())
