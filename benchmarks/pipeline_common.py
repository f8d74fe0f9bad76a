"""What the contenders of ``pipeline_vs_torch.py`` share: configuration, results, data, threads, and
the block splits the torch pipeline mirrors from FusionNet's plan."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
MODEL_FILE = HERE / "pipeline_model.py"
sys.path.insert(0, str(HERE))  # pipeline_model, also in spawned workers (they get sys.path)
sys.path.insert(1, str(HERE.parent))  # fusionnet (its schedules), also in spawned workers

FUSIONNET = [sys.executable, "-m", "fusionnet.cli.main"]
KINDS = ("torch pipe", "fusionnet", "fusionnet local")  # table order, after plain torch


@dataclass(frozen=True)
class Config:
    dim: int
    hidden: int
    layers: int
    batch_size: int
    microbatches: int
    steps: int
    warmup: int
    lr: float
    seed: int
    threads: int
    data_path: str
    # gpipe | 1f1b | zero-bubble | interleaved-1f1b: FusionNet's placement.schedule; torch's ScheduleGPipe /
    # Schedule1F1B / ScheduleInterleaved1F1B (for zero-bubble, torch's schedule runtime given FusionNet's
    # ZB-H1 programs: torch's own zero-bubble schedules need several stages per rank)
    schedule: str = "gpipe"
    chunks: int = 2  # interleaved-1f1b: stages per rank / sub-DAGs per compnode
    sandbox: str = "process"  # the compnodes' --sandbox: per-job worker processes (default) or off
    worker_sends: str = (
        "direct"  # the compnodes' --worker-sends: workers send values themselves, or via the daemon
    )
    worker_receives: str = "direct"  # the compnodes' --worker-receives: workers read values, or daemons relay
    inline_compute_ms: float | None = None  # the compnodes' --inline-compute-ms (None: their default)
    # the broker's --placement: the performance model, or the balanced split; or "blocks": the job names
    # its cuts (placement.cuts) at the balanced block split, the very cut torch's pipeline runs
    placement: str = "blocks"
    replica_interval: float | None = None  # the broker's --replica-interval (None: its default)
    steps_ahead: bool = False  # the broker's --steps-ahead: each step's call sent while the one before runs
    # The torch contenders' allocator: glibc's and torch's defaults (what a user of torch gets), or "kept",
    # the settings FusionNet's sandbox workers use (``fusionnet.daemon.memory.keep_freed_memory`` and huge
    # pages for large tensors, ``fusionnet.compnode.sandbox_preload``), to show what of a difference is
    # those settings alone.
    torch_allocator: str = "default"
    # mlp: ``pipeline_model.BlockStack`` (dim, hidden, layers); gpt2: a transformers GPT-2 of ``layers``
    # blocks of width ``dim`` (MLP ``hidden``, ``heads`` heads) on ``seq`` token ids out of ``vocab``
    model: str = "mlp"
    vocab: int = 8000
    seq: int = 64
    heads: int = 8

    @property
    def per_rank(self) -> int:
        """Stages each rank (compnode) holds."""
        return self.chunks if self.schedule == "interleaved-1f1b" else 1

    @property
    def model_kwargs(self) -> dict[str, int]:
        kwargs = {"dim": self.dim, "hidden": self.hidden, "layers": self.layers}
        if self.model == "gpt2":
            kwargs.update(vocab=self.vocab, heads=self.heads, seq=self.seq)
        return kwargs

    @property
    def builder(self) -> str:
        """The model's callable in ``pipeline_model.py``."""
        return "build_gpt2" if self.model == "gpt2" else "build"


@dataclass
class Result:
    name: str
    times: list[float] = field(default_factory=list)  # per step, warm-up included
    losses: list[float] = field(default_factory=list)
    error: str | None = None
    note: str = ""
    activation_peak: list[int] | None = None  # FusionNet: per stage, the most activation bytes held at once
    # FusionNet: per step (aligned with ``times``), the share of the step its stages did not compute,
    # averaged over the stages (metrics.jsonl's ``compute_seconds`` against ``seconds``)
    bubbles: list[float] = field(default_factory=list)
    # FusionNet: per step, the share of the step beyond its schedule run on its own measured compute with
    # free messages (metrics.jsonl's ``compute_path_seconds``): what the network, the runtime's
    # messaging and the broker's call cost on the critical path
    beyond_path: list[float] = field(default_factory=list)
    # per round of ``--repeat`` (set by ``pipeline_vs_torch``): its timed steps, kept apart so that each
    # round can be held against the other contenders' same round (``paired_ratio``)
    round_times: list[list[float]] = field(default_factory=list)

    def median(self, warmup: int) -> float | None:
        return self._median(self.times, warmup)

    def bubble(self, warmup: int) -> float | None:
        return self._median(self.bubbles, warmup)

    def beyond(self, warmup: int) -> float | None:
        return self._median(self.beyond_path, warmup)

    def _median(self, values: list[float], warmup: int) -> float | None:
        timed = values[warmup:] or values
        return statistics.median(timed) if timed and self.error is None else None

    def minimum(self, warmup: int) -> float | None:
        timed = self.times[warmup:] or self.times
        return min(timed) if timed and self.error is None else None


# ---- data and batches (shared by the torch contenders; FusionNet reads the same file) ------------------
def make_data(cfg: Config, samples: int) -> None:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(cfg.seed + 1)
    if cfg.model == "gpt2":  # token ids; the model predicts each next one (its labels are its inputs)
        inputs = torch.randint(0, cfg.vocab, (samples, cfg.seq), generator=g)
        labels = inputs.clone()
    else:
        inputs = torch.randn(samples, cfg.dim, generator=g)
        labels = torch.randint(0, cfg.dim, (samples,), generator=g)
    save_file({"inputs": inputs, "labels": labels}, cfg.data_path)


def load_batches(cfg: Config) -> list[tuple[Any, Any]]:
    import torch
    from safetensors.torch import load_file

    data = load_file(cfg.data_path)
    n = data["inputs"].shape[0]
    out = []
    for s in range(cfg.steps):
        idx = torch.arange(s * cfg.batch_size, (s + 1) * cfg.batch_size) % n
        out.append((data["inputs"][idx].contiguous(), data["labels"][idx].contiguous()))
    return out


HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"  # torch's switch, read once when its C library loads


@contextlib.contextmanager
def torch_allocator_env(allocator: str) -> Any:
    """The environment a torch contender is spawned in: its huge-page advice is read when torch loads,
    before ``set_threads`` runs, so it travels in the environment ("kept": on, as FusionNet's workers;
    "default": off, torch's own default, whatever the caller's environment says)."""
    before = os.environ.get(HUGE_PAGES_ENV)
    os.environ[HUGE_PAGES_ENV] = "1" if allocator == "kept" else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(HUGE_PAGES_ENV, None)
        else:
            os.environ[HUGE_PAGES_ENV] = before


def set_threads(threads: int, allocator: str = "default") -> None:
    """Torch's threads for a torch contender's process, and its allocator (``Config.torch_allocator``)."""
    if allocator == "kept":
        from fusionnet.daemon.memory import keep_freed_memory

        if not keep_freed_memory():
            raise RuntimeError("--torch-allocator kept: this C library refused the settings")
    import torch

    torch.set_num_threads(threads)
    with contextlib.suppress(RuntimeError):  # only settable before any inter-op work
        torch.set_num_interop_threads(1)


# ---- splits ---------------------------------------------------------------------------------------------
_NODE = re.compile(r"^(layer_norm|linear|gelu|add)(?:_(\d+))?$")


def _node_block(name: str) -> int | None:
    """The block a traced node belongs to (fx names the k-th call of an op ``op_k``; two linears a block)."""
    m = _NODE.match(name)
    if m is None:
        return None
    k = int(m.group(2) or 0)
    return k // 2 if m.group(1) == "linear" else k


_GPT2_BLOCK = re.compile(r"^lm\.transformer\.h\.(\d+)\.")
_GPT2_MLP = re.compile(r"^lm\.transformer\.h\.(\d+)\.mlp\.c_fc\.weight$")
_GPT2_EMBED = ("lm.transformer.wte.", "lm.transformer.wpe.")
_GPT2_HEAD = ("lm.transformer.ln_f.", "lm.lm_head.")


def split_from_plan(
    plan: dict[str, Any], layers: int, model: str = "mlp", round_cuts: bool = False
) -> list[tuple[int, int]]:
    """Per sub-DAG (in block order) its first and last block, from ``plan.json``'s ``nodes`` (MLP blocks) and
    ``params``. Raises when a cut falls inside a block, blocks are not contiguous, or (GPT-2) the embeddings
    or the head are not with the first or last block, as torch's stages hold them. ``round_cuts`` (GPT-2):
    a block cut in two goes to the sub-DAG that holds its MLP (two thirds of its work), so the cut moves to
    the nearest block boundary."""
    owner: dict[int, int] = {}
    ends: dict[str, set[int]] = {"embeddings": set(), "head": set()}
    if model == "gpt2" and round_cuts:
        for sd in plan["subdags"]:
            for m in map(_GPT2_MLP.match, sd.get("params", [])):
                if m is not None:
                    owner[int(m.group(1))] = sd.get("subdag", sd.get("index"))
    for sd in plan["subdags"]:
        index = sd.get("subdag", sd.get("index"))
        params = sd.get("params", [])
        if model == "gpt2":
            blocks = {int(m.group(1)) for m in map(_GPT2_BLOCK.match, params) if m is not None}
            blocks -= set(owner) if round_cuts else set()
            for part, prefixes in (("embeddings", _GPT2_EMBED), ("head", _GPT2_HEAD)):
                if any(p.startswith(prefixes) for p in params):
                    ends[part].add(index)
        else:
            blocks = {b for b in map(_node_block, sd["nodes"]) if b is not None}
            blocks |= {int(p.split(".")[1]) for p in params if p.startswith("blocks.")}
        for b in blocks:
            if owner.setdefault(b, index) != index:
                raise ValueError(f"block {b} is cut between sub-DAGs {owner[b]} and {index}")
    if sorted(owner) != list(range(layers)):
        raise ValueError(f"plan covers blocks {sorted(owner)}, expected 0..{layers - 1}")
    if model == "gpt2":
        for part, block in (("embeddings", 0), ("head", layers - 1)):
            if ends[part] != {owner[block]}:
                raise ValueError(f"the {part} are in sub-DAGs {sorted(ends[part])}, not with block {block}")
    stages: dict[int, list[int]] = {}
    for b, index in owner.items():
        stages.setdefault(index, []).append(b)
    split = sorted((min(bs), max(bs)) for bs in stages.values())
    for (_, last), (first, _) in itertools.pairwise(split):
        if first != last + 1:
            raise ValueError(f"sub-DAG blocks are not contiguous: {format_split(split)}")
    return split


def balanced_split(layers: int, stages: int) -> list[tuple[int, int]]:
    bounds = [round(i * layers / stages) for i in range(stages + 1)]
    return [(bounds[i], bounds[i + 1] - 1) for i in range(stages)]


def block_cuts(cfg: Config, pieces: int) -> list[str]:
    """``placement.cuts`` that begin each piece of the balanced block split but the first at its first
    block (module paths: ``blocks.K``, or GPT-2's ``lm.transformer.h.K``)."""
    prefix = "lm.transformer.h." if cfg.model == "gpt2" else "blocks."
    return [f"{prefix}{first}" for first, _ in balanced_split(cfg.layers, pieces)[1:]]


def format_split(split: list[tuple[int, int]]) -> str:
    return "|".join(f"{a}-{b}" if a != b else str(a) for a, b in split)
