"""The job file as pydantic models (interface.md "Job definition file").

Every model forbids unknown keys: a misspelt key would otherwise be silently ignored and the job would
run with a default the user did not ask for. Numbers are strict: an integer key refuses ``8.5`` and
``"8"``, a float key (``lr``) refuses ``"0.1"`` and ``true`` and accepts any YAML number. Validators
that need a key path other than their own raise ``KeyProblem`` so that ``fusionnet.job.parse`` can name
the exact key.

Checks that need the file system or user code (files exist, the entry point returns a module, data
lengths agree) live in ``fusionnet.job.loader``; everything here is pure.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    field_validator,
    model_validator,
)

from fusionnet.job import losses, optim
from fusionnet.job.kwargs_check import KwargProblem


class KeyProblem(ValueError):
    """A validation problem at ``key`` (a path relative to the model being validated)."""

    def __init__(self, key: tuple[str, ...], text: str) -> None:
        super().__init__(f"{'.'.join(key)}: {text}")
        self.key = key
        self.text = text


# Limits shared with the wire (``RunSpec``): a job file is refused by ``plan`` and ``run`` exactly where
# ``submit`` would be refused by the broker, and nothing is allocated from a number before it is checked.
MAX_NAME_CHARS = 200
MAX_PATH_CHARS = 1024  # entrypoint, data and weights paths (PATH_MAX is 4096; real ones are short)
MAX_BATCH_SIZE = 1 << 24
MAX_MICROBATCHES = 1 << 16
MAX_STEPS = 10_000_000
MAX_COMPNODES = 1024
MAX_BLOCK_SIZE = 1 << 20

PosInt = Annotated[int, Field(strict=True, gt=0)]
# Strict, as the integers are: pydantic's lax float would take ``"0.1"`` (while ``batch_size: "8"`` is
# refused) and YAML's ``true`` as 1.0. An int is still a float here (``lr: 1``).
PosFloat = Annotated[float, Field(strict=True, gt=0, allow_inf_nan=False)]
# Parameters are float32 by default: a learning rate beyond its range overflows inside the optimizer,
# where the error would name the optimizer's arguments instead of ``lr``.
MAX_LR = 1e30
LearningRate = Annotated[float, Field(strict=True, gt=0, le=MAX_LR, allow_inf_nan=False)]
Seed = Annotated[int, Field(strict=True, ge=0, lt=2**63)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
PathStr = Annotated[str, Field(min_length=1, max_length=MAX_PATH_CHARS)]


def _bounded(limit: int) -> Any:
    return Annotated[int, Field(strict=True, gt=0, le=limit)]


def _microbatch_count(value: Any) -> int | str:
    """``data.microbatches``: a count, or ``auto``, with the messages of a plain bounded integer."""
    if value == "auto" and isinstance(value, str):
        return value
    if isinstance(value, bool) or not isinstance(value, int):
        raise KeyProblem((), f"must be an integer or 'auto' (got {value!r:.60})")
    if value <= 0:
        raise KeyProblem((), f"must be > 0 (got {value})")
    if value > MAX_MICROBATCHES:
        raise KeyProblem((), f"must be <= {MAX_MICROBATCHES} (got {value})")
    return value


MicrobatchCount = Annotated[int | Literal["auto"], PlainValidator(_microbatch_count)]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ModelSpec(_Strict):
    entrypoint: PathStr  # FILE.py:callable (relative to the job file) or package.module:callable
    kwargs: dict[str, Any] = {}
    weights: PathStr | None = None  # initial state: a safetensors file or a save_pretrained folder

    @field_validator("entrypoint")
    @classmethod
    def _entrypoint_form(cls, value: str) -> str:
        module, sep, attr = value.rpartition(":")
        if not sep or not module or not attr or not all(p.isidentifier() for p in attr.split(".")):
            raise ValueError(f"expected FILE.py:callable or package.module:callable (got {value!r})")
        return value


def _kwargs_problem(key: tuple[str, ...], error: ValueError) -> KeyProblem:
    """A refused ``kwargs`` mapping as a ``KeyProblem``: at the one argument when the check names it
    (``loss.kwargs.label_smoothing``), else at ``kwargs`` with the check's message."""
    if isinstance(error, KwargProblem):
        return KeyProblem((*key, error.key), error.text)
    return KeyProblem(key, str(error))


class LossSpec(_Strict):
    name: NonEmptyStr
    kwargs: dict[str, Any] = {}

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        return losses.check_loss_name(value)

    @model_validator(mode="after")
    def _kwargs_work(self) -> LossSpec:
        try:
            losses.check_loss_kwargs(self.name, self.kwargs)
        except ValueError as e:
            raise _kwargs_problem(("kwargs",), e) from e
        return self


class DataSpec(_Strict):
    path: PathStr  # .safetensors ("inputs", "labels") or .txt (char-level text)
    batch_size: _bounded(MAX_BATCH_SIZE)
    # ``auto``: the performance model chooses among divisors of batch_size (``batches.microbatch_candidates``)
    microbatches: MicrobatchCount = 1
    block_size: _bounded(MAX_BLOCK_SIZE) | None = None  # text data only: tokens per sample

    @model_validator(mode="after")
    def _consistent(self) -> DataSpec:
        if self.microbatches != "auto" and self.microbatches > self.batch_size:
            raise KeyProblem(
                ("microbatches",),
                f"must be <= data.batch_size ({self.microbatches} > {self.batch_size}): "
                "every micro-batch needs at least one sample",
            )
        is_text = self.path.lower().endswith(".txt")
        if is_text and self.block_size is None:
            raise KeyProblem(("block_size",), "required for text data (a .txt path)")
        if not is_text and self.block_size is not None:
            raise KeyProblem(("block_size",), "only allowed for text data (a .txt path)")
        return self


class OptimizerOverride(_Strict):
    name: NonEmptyStr | None = None
    lr: LearningRate | None = None
    kwargs: dict[str, Any] = {}


class OptimizerSpec(_Strict):
    name: NonEmptyStr
    lr: LearningRate
    kwargs: dict[str, Any] = {}
    per_op: dict[str, OptimizerOverride] = {}  # parameter-name glob -> override, first match wins

    @field_validator("name")
    @classmethod
    def _known(cls, value: str) -> str:
        optim.canonical_name(value)
        return value

    @model_validator(mode="after")
    def _settings_work(self) -> OptimizerSpec:
        try:
            kwargs = optim.normalize_kwargs(self.kwargs)
            default = optim.ResolvedOptim(optim.canonical_name(self.name), float(self.lr), kwargs)
            optim.check_optimizer(default.cls_name, default.lr, default.kwargs)
        except ValueError as e:
            raise _kwargs_problem(("kwargs",), e) from e
        for glob, over in self.per_op.items():
            if not glob:
                raise KeyProblem(("per_op",), "an empty glob matches no parameter")
            if over.name is not None:
                try:
                    optim.canonical_name(over.name)
                except ValueError as e:
                    raise KeyProblem(("per_op", glob, "name"), str(e)) from e
            try:
                given = over.kwargs if "kwargs" in over.model_fields_set else None
                resolved = optim.resolve_override(default, over.name, over.lr, given)
                optim.check_optimizer(resolved.cls_name, resolved.lr, resolved.kwargs)
            except ValueError as e:
                raise _kwargs_problem(("per_op", glob, "kwargs"), e) from e
        return self


# Pipeline schedules (``fusionnet.schedules``); ``auto`` lets the performance model choose.
SCHEDULE_NAMES = ("gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "auto")
MAX_CHUNKS = 16
MAX_CUTS = MAX_COMPNODES * MAX_CHUNKS
CutName = Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
Schedule = Literal["gpipe", "1f1b", "zero-bubble", "interleaved-1f1b", "auto"]


class PlacementSpec(_Strict):
    compnodes: _bounded(MAX_COMPNODES) = 1  # number of sub-DAGs / compnodes
    # Activations/gradients on the wire: anything but none is inexact (``fusionnet.wire.compression``).
    wire_compression: Literal["none", "bf16", "fp16", "int8-ef"] = "none"
    # AES-GCM of frames on the direct path; auto: on unless both ends are loopback (``wire/crypt.py``).
    wire_encryption: Literal["auto", "on", "off"] = "auto"
    schedule: Schedule = "gpipe"  # the order of each sub-DAG's forwards and backwards in a step
    # interleaved-1f1b only: sub-DAGs (virtual stages) per compnode; the model is cut into compnodes x
    # chunks sub-DAGs, compnode d holding sub-DAGs d, compnodes + d, ... (default 2)
    chunks: _bounded(MAX_CHUNKS) | None = None
    # Where sub-DAGs 1, 2, ... begin (``fusionnet.dag.cuts``): an op's IR name or a module's path each,
    # compnodes x chunks - 1 of them, in the model's order. Unset: the broker's placement policy cuts.
    cuts: Annotated[list[CutName], Field(max_length=MAX_CUTS)] | None = None

    @model_validator(mode="after")
    def _chunks_go_with_interleaving(self) -> PlacementSpec:
        if self.chunks is not None and self.schedule != "interleaved-1f1b":
            raise KeyProblem(
                ("chunks",),
                f"only schedule interleaved-1f1b runs several sub-DAGs per compnode, not {self.schedule}",
            )
        if self.chunks is not None and self.chunks < 2:
            raise KeyProblem(
                ("chunks",), f"interleaved-1f1b needs >= 2 chunks per compnode, got {self.chunks}"
            )
        return self

    @model_validator(mode="after")
    def _cuts_make_the_subdags(self) -> PlacementSpec:
        if self.cuts is not None and len(self.cuts) + 1 != self.subdags:
            raise KeyProblem(
                ("cuts",),
                f"{len(self.cuts)} cut(s) make {len(self.cuts) + 1} sub-DAGs, but placement.compnodes"
                + (" x chunks" if self.chunks_per_compnode > 1 else "")
                + f" asks for {self.subdags}",
            )
        return self

    @property
    def chunks_per_compnode(self) -> int:
        """Sub-DAGs per compnode: 1, or interleaved-1f1b's chunks (default 2)."""
        if self.schedule != "interleaved-1f1b":
            return 1
        return self.chunks or 2

    @property
    def subdags(self) -> int:
        """How many sub-DAGs the model is cut into."""
        return self.compnodes * self.chunks_per_compnode


class JobSpec(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=MAX_NAME_CHARS)]
    task: Literal["train", "grad", "infer", "generate"]  # generate: deployments only (runs as infer)
    model: ModelSpec
    loss: LossSpec | None = None  # None: the model's forward(inputs, labels) returns the loss
    data: DataSpec
    optimizer: OptimizerSpec | None = None  # required when task == "train"
    steps: _bounded(MAX_STEPS) = 1
    seed: Seed = 0
    # fp32 | bf16 | fp16 (fp16: fp32 master weights + dynamic loss scaling); ``fusionnet.dag.precision``
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    placement: PlacementSpec = PlacementSpec()

    @model_validator(mode="after")
    def _task_needs(self) -> JobSpec:
        if self.task == "train" and self.optimizer is None:
            raise KeyProblem(("optimizer",), "required when task is train")
        problem = interleaved_count_problem(self)
        if problem is not None:
            raise KeyProblem(("data", "microbatches"), problem)
        return self


def interleaved_count_problem(spec: JobSpec) -> str | None:
    """Why ``spec``'s micro-batch count cannot train interleaved (None: it can, or need not): the order
    needs a multiple of the compnodes (``schedules.generators.interleaved_1f1b``); forwards run any."""
    m, p = spec.data.microbatches, spec.placement.compnodes
    if (
        spec.placement.chunks_per_compnode == 1
        or spec.task in ("infer", "generate")
        or m == "auto"
        or m % p == 0
    ):
        return None
    return (
        f"placement.schedule interleaved-1f1b trains on a multiple of placement.compnodes ({p}) "
        f"micro-batches per step, got {m}"
    )
