"""What travels with a job between ``submit``, the broker and compnodes, validated on arrival.

A job on the wire is: the IR (msgpack bytes, ``fusionnet.dag.codec``), the initial state and the
dataset (safetensors bytes, ``blobs``), and a ``RunSpec``: the few job-file settings the execution
plane needs. Everything a peer sends is checked here with pydantic (strict; unknown keys ignored, as
a newer peer may add some) before anything acts on it; the model's code itself never travels (the IR
does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from fusionnet.errors import JobError
from fusionnet.job.batches import batch_indices, infer_batches, split_microbatches
from fusionnet.job.loader import LoadedJob
from fusionnet.job.schema import (
    MAX_BATCH_SIZE,
    MAX_COMPNODES,
    MAX_CUTS,
    MAX_MICROBATCHES,
    MAX_NAME_CHARS,
    MAX_STEPS,
    OptimizerSpec,
)

MAX_MICROBATCH_CHOICES = 64


class RunSpec(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    name: str = Field(min_length=1, max_length=MAX_NAME_CHARS)
    task: Literal["train", "grad", "infer"]
    batch_size: int = Field(ge=1, le=MAX_BATCH_SIZE)
    microbatches: int = Field(ge=1, le=MAX_MICROBATCHES)
    steps: int = Field(ge=1, le=MAX_STEPS)
    n_samples: int = Field(ge=1, le=1 << 40)
    # mean | sum | none | targets:I (a class loss's mean over targets not ignore_index I: ``job.losses``)
    loss_reduction: str = Field("mean", pattern=r"^(mean|sum|none|targets:-?[0-9]{1,12})$")
    compnodes: int = Field(ge=1, le=MAX_COMPNODES)
    optimizer: dict[str, Any] | None = None  # an OptimizerSpec document, re-validated by ``optimizer_spec``
    # Autocast dtype of the forward pass (``fusionnet.dag.precision``); older peers omit it: fp32.
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    # Pipeline schedule (``fusionnet.schedules``); older peers omit it: gpipe. The broker turns ``auto``
    # into a name before a compnode sees it.
    schedule: Literal["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "auto"] = "gpipe"
    # interleaved-1f1b: sub-DAGs per compnode (the job is cut into compnodes x chunks sub-DAGs, compnode
    # d holding d, compnodes + d, ...); 1 otherwise. Older peers omit it: 1.
    chunks: int = Field(default=1, ge=1, le=16)
    # ``data.microbatches: auto``: the counts the submitter found the graph runs; the broker picks one at
    # its first placement and sends it as ``microbatches`` with none here. Older peers omit it: none.
    microbatch_choices: list[int] = Field(default_factory=list, max_length=MAX_MICROBATCH_CHOICES)
    # ``placement.wire_compression`` / ``placement.wire_encryption``; older peers omit them: the defaults.
    wire_compression: Literal["none", "bf16", "fp16", "int8-ef"] = "none"
    wire_encryption: Literal["auto", "on", "off"] = "auto"
    # ``placement.cuts``: where sub-DAGs 1, 2, ... begin (op names or module paths, ``dag.cuts``), checked
    # against the IR on arrival; empty: the broker's placement policy cuts. Older peers omit it: empty.
    cuts: list[Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]] = Field(
        default_factory=list, max_length=MAX_CUTS
    )

    @model_validator(mode="after")
    def _optimizer_fits_task(self) -> RunSpec:
        if self.optimizer is not None:
            try:
                OptimizerSpec.model_validate(self.optimizer)
            except (ValidationError, ValueError) as e:
                raise ValueError(f"optimizer: {_first_error(e)}") from None
        if self.task == "train" and self.optimizer is None:
            raise ValueError("task train needs an optimizer")
        if not all(1 <= m <= self.batch_size for m in self.microbatch_choices):
            raise ValueError(f"microbatch_choices: each must be 1..batch_size ({self.batch_size})")
        if (self.chunks > 1) != (self.schedule == "interleaved-1f1b"):
            raise ValueError("chunks: > 1 with schedule interleaved-1f1b only, which needs it")
        if self.cuts and len(self.cuts) + 1 != self.subdags:
            raise ValueError(
                f"cuts: {len(self.cuts)} cut(s) for {self.subdags} sub-DAGs (compnodes x chunks)"
            )
        return self

    @property
    def subdags(self) -> int:
        """How many sub-DAGs the job is cut into: compnodes x chunks."""
        return self.compnodes * self.chunks

    def optimizer_spec(self) -> OptimizerSpec | None:
        if self.optimizer is None:
            return None
        try:
            return OptimizerSpec.model_validate(self.optimizer)
        except (ValidationError, ValueError) as e:
            raise JobError(f"job {self.name!r}: optimizer: {_first_error(e)}") from None

    @property
    def step_count(self) -> int:
        """Steps actually run: ``steps`` for train/grad, one pass over the data for infer."""
        if self.task == "infer":
            return len(infer_batches(self.n_samples, self.batch_size))
        return self.steps

    def microbatch_slices(self, step: int) -> tuple[Any, list[slice]]:
        """Sample indices of ``step`` and their micro-batch slices (interface.md semantics)."""
        if not 0 <= step < self.step_count:
            raise JobError(f"job {self.name!r}: step {step} outside 0..{self.step_count - 1}")
        if self.task == "infer":
            idx = infer_batches(self.n_samples, self.batch_size)[step]
        else:
            idx = batch_indices(step, self.batch_size, self.n_samples)
        return idx, split_microbatches(len(idx), min(self.microbatches, len(idx)))

    def microbatch_sizes(self, step: int) -> list[int]:
        idx, slices = self.microbatch_slices(step)
        return [len(idx[s]) for s in slices]

    @classmethod
    def parse(cls, doc: object) -> RunSpec:
        if not isinstance(doc, dict):
            raise JobError(f"run spec must be a map, got {type(doc).__name__}")
        try:
            spec = cls.model_validate(doc)
        except ValidationError as e:
            raise JobError(f"run spec: {_first_error(e)}") from None
        return spec


def run_spec_of(
    job: LoadedJob, loss_reduction: str, *, microbatches: int | None = None, choices: Sequence[int] = ()
) -> RunSpec:
    """``microbatches`` and ``choices``: for ``data.microbatches: auto``, the traced count and the counts
    the graph runs, which the broker chooses among."""
    spec = job.spec
    return RunSpec(
        name=spec.name,
        task=spec.task,
        batch_size=spec.data.batch_size,
        microbatches=spec.data.microbatches if microbatches is None else microbatches,
        microbatch_choices=list(choices),
        steps=spec.steps,
        n_samples=int(job.inputs.shape[0]),
        loss_reduction=loss_reduction,
        compnodes=spec.placement.compnodes,
        optimizer=None if spec.optimizer is None else spec.optimizer.model_dump(mode="json"),
        precision=spec.precision,
        schedule=spec.placement.schedule,
        chunks=spec.placement.chunks_per_compnode,
        wire_compression=spec.placement.wire_compression,
        wire_encryption=spec.placement.wire_encryption,
        cuts=list(spec.placement.cuts or ()),
    )


def select_fields(fields: dict[str, Any], wanted: set[str], spec: RunSpec, step: int) -> list[dict[str, Any]]:
    """The dataset ``fields`` a sub-DAG reads (``wanted``), cut into ``step``'s micro-batches."""
    idx, slices = spec.microbatch_slices(step)
    return [{k: fields[k][idx[s]] for k in wanted if k in fields} for s in slices]


def _first_error(e: Exception) -> str:
    if isinstance(e, ValidationError):
        err = e.errors()[0]
        where = ".".join(str(p) for p in err.get("loc", ())) or "(root)"
        return f"{where}: {err.get('msg', 'invalid')}"
    return str(e)
