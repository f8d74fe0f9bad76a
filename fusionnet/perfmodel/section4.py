"""FusionAI section 4: 50 x RTX 3080 against 4 x H100 on Bert-Large and a GPT-3-style model.

Each model is split as in Figure 4: embedding, one attention and one FFN sub-DAG per layer, head
(50 sub-DAGs for 24 layers). The 3080 swarm runs one sub-DAG per GPU; the H100s run sub-DAGs
1 | 2-25 | 26-49 | 50. Computation uses each GPU's FP32 tensor-core TFLOPS from Table 1 at
lambda = 1, as the paper does; every cut sends one micro-batch's activations (``batch x seq x
hidden`` fp32 values) over an alpha-beta link. For each latency and bandwidth, eq. (3) gives the
FP latency of one batch and eq. (4) the time of ``n_b`` pipelined batches (throughput = n_b / time);
the schedule simulator recomputes eq. (4) independently as a cross-check.

The finding to reproduce: the 3080 swarm reaches a throughput similar to the H100s (a pipeline's
throughput is set by its slowest resource, often the same link) at a higher latency (it crosses
49 links instead of 3).

Run: ``python -m fusionnet.perfmodel.section4 [--plot FILE.png] [--json FILE]`` (or the benchmark
script / CLI subcommand that wrap ``main``).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from fusionnet.perfmodel.catalog import CATALOG
from fusionnet.perfmodel.models import BERT_LARGE, GPT3_24L_4096, TransformerConfig, transformer_blocks
from fusionnet.perfmodel.placement_cost import evaluate_assignment
from fusionnet.perfmodel.timing import latency_eq3, pipelined_eq4
from fusionnet.perfmodel.types import CostGraph, Link, Swarm, Workload

BANDWIDTHS_BPS = (10e6, 30e6, 100e6, 300e6, 1e9, 3e9, 10e9, 30e9, 100e9)
LATENCIES_S = (1e-3, 10e-3, 50e-3)
MODELS = {"bert-large": (BERT_LARGE, False), "gpt3-24l-4096": (GPT3_24L_4096, True)}


@dataclass(frozen=True)
class Row:
    model: str
    swarm: str
    latency_s: float
    bandwidth_bps: float
    eq3_latency_s: float
    eq4_seconds: float
    throughput: float  # batches per second
    simulated_seconds: float | None
    bottleneck_s: float


def figure4_assignments(graph: CostGraph) -> tuple[dict[str, int], dict[str, int]]:
    """(50 x 3080: sub-DAG k on GPU k, 4 x H100: 1 | 2-25 | 26-49 | 50), data placeholders joining
    the first sub-DAG."""
    subdags = [op.name for op in graph.ops if op.kind != "placeholder"]
    n = len(subdags)
    first = subdags[0]
    swarm_a = {name: i for i, name in enumerate(subdags)}
    half = 1 + (n - 2) // 2
    swarm_b = {
        name: (0 if i == 0 else 3 if i == n - 1 else 1 if i < half else 2) for i, name in enumerate(subdags)
    }
    for op in graph.ops:
        if op.kind == "placeholder":
            swarm_a[op.name] = swarm_a[first]
            swarm_b[op.name] = swarm_b[first]
    return swarm_a, swarm_b


def analyse(
    name: str,
    cfg: TransformerConfig,
    *,
    causal: bool,
    n_batches: int = 512,
    bandwidths: tuple[float, ...] = BANDWIDTHS_BPS,
    latencies: tuple[float, ...] = LATENCIES_S,
    simulate: bool = True,
) -> list[Row]:
    graph = transformer_blocks(cfg, causal_lm_head=causal)
    a_3080, a_h100 = figure4_assignments(graph)
    n_sub = len(set(a_3080.values()))
    setups = (
        (f"{n_sub}x RTX 3080", CATALOG["RTX 3080"], n_sub, a_3080),
        ("4x H100", CATALOG["H100"], 4, a_h100),
    )
    workload = Workload(n_batches, "infer", "gpipe")
    rows = []
    for latency in latencies:
        for bw in bandwidths:
            link = Link.from_bandwidth(latency, bw / 8)
            for label, entry, count, assign in setups:
                swarm = Swarm(tuple(entry.spec(name=f"{entry.name} #{i}") for i in range(count)), {}, link)
                cost = evaluate_assignment(graph, swarm, workload, assign)
                why = cost.memory_violation(swarm)
                if why is not None:
                    raise ValueError(f"{name} on {label}: {why}")
                compute = [s.fp for s in cost.stages]
                comm = [s.recv_fwd for s in cost.stages]
                eq4 = pipelined_eq4(compute, comm, n_batches)
                rows.append(
                    Row(
                        model=name,
                        swarm=label,
                        latency_s=latency,
                        bandwidth_bps=bw,
                        eq3_latency_s=latency_eq3(compute, comm),
                        eq4_seconds=eq4,
                        throughput=n_batches / eq4,
                        simulated_seconds=cost.step_seconds if simulate else None,
                        bottleneck_s=max(max(compute), max(comm)),
                    )
                )
    return rows


def _fmt_bw(bps: float) -> str:
    for unit, size in (("Gbps", 1e9), ("Mbps", 1e6)):
        if bps >= size:
            return f"{bps / size:g} {unit}"
    return f"{bps:g} bps"


def table(rows: list[Row]) -> str:
    """Side by side per (model, latency, bandwidth): latency and throughput of both swarms."""
    out = [
        f"{'model':<14} {'alpha':>6} {'bandwidth':>10} | {'3080 lat s':>10} {'H100 lat s':>10} "
        f"{'lat x':>6} | "
        f"{'3080 b/s':>9} {'H100 b/s':>9} {'thr x':>6} | {'sim/eq4':>7}"
    ]
    by_key: dict[tuple, dict[str, Row]] = {}
    for r in rows:
        by_key.setdefault((r.model, r.latency_s, r.bandwidth_bps), {})[r.swarm.split("x ")[1]] = r
    for (model, lat, bw), pair in by_key.items():
        a, b = pair["RTX 3080"], pair["H100"]
        sims = [r.simulated_seconds / r.eq4_seconds for r in (a, b) if r.simulated_seconds is not None]
        sim = f"{max(sims, key=lambda x: abs(x - 1)):.4f}" if sims else "-"
        out.append(
            f"{model:<14} {lat * 1e3:>4g}ms {_fmt_bw(bw):>10} | {a.eq3_latency_s:>10.4g} "
            f"{b.eq3_latency_s:>10.4g} "
            f"{a.eq3_latency_s / b.eq3_latency_s:>6.2f} | {a.throughput:>9.4g} {b.throughput:>9.4g} "
            f"{a.throughput / b.throughput:>6.2f} | {sim:>7}"
        )
    return "\n".join(out)


def summary(rows: list[Row]) -> dict:
    """Median ratios 3080 / H100 per model, and the worst simulator vs eq. (4) disagreement."""
    res: dict = {}
    for model in dict.fromkeys(r.model for r in rows):
        pairs: dict[tuple, dict[str, Row]] = {}
        for r in rows:
            if r.model == model:
                pairs.setdefault((r.latency_s, r.bandwidth_bps), {})[r.swarm.split("x ")[1]] = r
        thr = [p["RTX 3080"].throughput / p["H100"].throughput for p in pairs.values()]
        lat = [p["RTX 3080"].eq3_latency_s / p["H100"].eq3_latency_s for p in pairs.values()]
        res[model] = {
            "median_throughput_ratio_3080_vs_h100": statistics.median(thr),
            "min_throughput_ratio": min(thr),
            "max_throughput_ratio": max(thr),
            "median_latency_ratio_3080_vs_h100": statistics.median(lat),
            "min_latency_ratio": min(lat),
        }
    sims = [abs(r.simulated_seconds / r.eq4_seconds - 1) for r in rows if r.simulated_seconds is not None]
    res["max_simulator_vs_eq4_rel_diff"] = max(sims) if sims else None
    return res


def plot(rows: list[Row], path: Path) -> bool:
    """Latency and throughput vs bandwidth per model; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    models = list(dict.fromkeys(r.model for r in rows))
    fig, axes = plt.subplots(len(models), 2, figsize=(11, 4 * len(models)), squeeze=False)
    for i, model in enumerate(models):
        for swarm in dict.fromkeys(r.swarm for r in rows):
            for lat in dict.fromkeys(r.latency_s for r in rows):
                sel = [r for r in rows if r.model == model and r.swarm == swarm and r.latency_s == lat]
                bws = [r.bandwidth_bps / 1e9 for r in sel]
                style = "-o" if "3080" in swarm else "--s"
                label = f"{swarm}, {lat * 1e3:g} ms"
                axes[i][0].plot(bws, [r.eq3_latency_s for r in sel], style, label=label, markersize=3)
                axes[i][1].plot(bws, [r.throughput for r in sel], style, label=label, markersize=3)
        for j, ylabel in enumerate(("FP latency of one batch (s), eq. 3", "throughput (batches/s), eq. 4")):
            ax = axes[i][j]
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("bandwidth (Gbps)")
            ax.set_ylabel(ylabel)
            ax.set_title(model)
            ax.grid(True, which="both", alpha=0.3)
        axes[i][1].legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fusionnet section4", description=__doc__.split("\n\n")[0])
    p.add_argument("--n-batches", type=int, default=512, help="pipelined batches n_b (default 512)")
    p.add_argument("--batch-size", type=int, default=1, help="samples per batch (default 1)")
    p.add_argument("--gpt-seq", type=int, default=GPT3_24L_4096.seq, help="GPT-3-style sequence length")
    p.add_argument(
        "--plot", type=Path, default=Path("section4.png"), help="PNG to write (default section4.png)"
    )
    p.add_argument("--json", type=Path, help="also write every row as JSON")
    p.add_argument("--no-plot", action="store_true", help="do not write the plot")
    p.add_argument("--no-simulate", action="store_true", help="skip the simulator cross-check")
    args = p.parse_args(argv)
    if args.n_batches < 1 or args.batch_size < 1 or args.gpt_seq < 1:
        p.error("--n-batches, --batch-size and --gpt-seq must be positive")
    rows: list[Row] = []
    for name, (cfg, causal) in MODELS.items():
        cfg = replace(cfg, batch=args.batch_size, seq=args.gpt_seq if causal else cfg.seq)
        rows += analyse(name, cfg, causal=causal, n_batches=args.n_batches, simulate=not args.no_simulate)
    print(table(rows))
    result = summary(rows)
    if args.no_plot:
        result["plot"] = None
    elif plot(rows, args.plot):
        result["plot"] = str(args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    else:
        result["plot"] = None
        print("matplotlib is not installed (pip install 'fusionnet[plot]'); no plot written", file=sys.stderr)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=1) + "\n")
    print(json.dumps(result, default=lambda x: None if isinstance(x, float) and math.isnan(x) else x))
    return 0


if __name__ == "__main__":
    sys.exit(main())
