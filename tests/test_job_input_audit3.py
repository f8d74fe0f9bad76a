"""Bad input a third audit found reported as the wrong thing: each is refused with one line that starts
with the key at fault, never an internal error (exit 1), a failure blamed on the model, a C++ backtrace,
or a job silently different from the file.

- data tensors of a dtype FusionNet does not carry (float8, uint16/64, complex) name ``data.path``, the
  tensor and its dtype (float8 had no ``isfinite``, uint64 no ``min``: both ended inside torch);
- a ``model.safetensors.index.json`` nested past the stack is ``model.weights: ...: not valid JSON``;
- YAML 1.1 integer forms: ``steps: 1:30`` is not 90, ``seed: 010`` is not 8;
- a torch error raised while building the model keeps its message but not its C++ backtrace.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from fusionnet.cli.main import EXIT_BAD_INPUT, main
from fusionnet.errors import JobError
from fusionnet.job.loader import check_job_without_model, load_job, load_job_spec
from fusionnet.job.parse import parse_yaml_text
from fusionnet.job.preflight import DATA_DTYPES, short_error
from fusionnet.wire.header import ALLOWED_DTYPES
from tests.test_job_refusals_audit import _copy as copy_example
from tests.test_job_refusals_audit import _one_line

REPO = Path(__file__).resolve().parent.parent
MLP = REPO / "examples" / "mlp"

pytestmark = pytest.mark.timeout(120)


def _copy(tmp: Path, **keys: Any) -> Path:
    """The MLP example copied to ``tmp/job`` with dotted ``keys`` set in its job.yaml."""
    return copy_example(MLP, tmp, **keys)


def _with_data(tmp: Path, inputs: torch.dtype | None = None, labels: torch.dtype | None = None) -> Path:
    job = _copy(tmp)
    data = load_file(str(job.parent / "data.safetensors"))
    if inputs is not None:
        data["inputs"] = data["inputs"].to(inputs)
    if labels is not None:
        data["labels"] = data["labels"].to(labels)
    save_file({k: v.contiguous() for k, v in data.items()}, str(job.parent / "data.safetensors"))
    return job


# -- data dtypes ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "dtype"),
    [
        ("inputs", torch.float8_e4m3fn),
        ("inputs", torch.float8_e5m2),
        ("inputs", torch.uint16),
        ("inputs", torch.complex64),
        ("labels", torch.float8_e4m3fn),
        ("labels", torch.uint64),
        ("labels", torch.uint32),
    ],
)
def test_data_of_a_dtype_the_wire_does_not_carry_names_the_tensor(
    tmp_path: Path, name: str, dtype: torch.dtype
) -> None:
    job = _with_data(tmp_path, **{name: dtype})
    shown = str(dtype).removeprefix("torch.")
    says = rf"^data\.path: data\.safetensors: '{name}' has dtype {shown}, "
    # In the command's own process (no model code) and in the full load alike.
    with pytest.raises(JobError, match=says):
        check_job_without_model(job)
    with pytest.raises(JobError, match=says):
        load_job(job)


@pytest.mark.parametrize(("name", "dtype"), [("labels", torch.float8_e4m3fn), ("labels", torch.uint64)])
def test_plan_refuses_such_data_as_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], name: str, dtype: torch.dtype
) -> None:
    job = _with_data(tmp_path, **{name: dtype})
    assert main(["plan", str(job)]) == EXIT_BAD_INPUT
    line = _one_line(capsys, "plan", "data.path: data.safetensors: ")
    assert f"'{name}' has dtype {str(dtype).removeprefix('torch.')}" in line


def test_data_dtypes_are_the_wires() -> None:
    # The job package may not import the wire (same layer): the two lists are kept equal here.
    assert set(ALLOWED_DTYPES.values()) == DATA_DTYPES


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.uint8])
def test_labels_of_a_carried_dtype_pass_the_data_checks(tmp_path: Path, dtype: torch.dtype) -> None:
    check_job_without_model(_with_data(tmp_path, labels=dtype))


FLOAT8_BUFFER = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)
        self.register_buffer("scale", torch.tensor([float("nan")]).to(torch.float8_e4m3fn))

    def forward(self, x):
        return self.fc(x)

def build():
    return M()
"""


def test_a_float8_tensor_of_the_model_is_checked_not_crashed_on(tmp_path: Path) -> None:
    job = _copy(tmp_path, **{"model.kwargs": {}})
    (job.parent / "model.py").write_text(FLOAT8_BUFFER)
    with pytest.raises(JobError, match=r"^model\.entrypoint: 'scale' holds NaN or inf"):
        load_job(job)


# -- weights index -------------------------------------------------------------------------------------


def _with_index(tmp: Path, text: str) -> Path:
    job = _copy(tmp, **{"model.weights": "pre"})
    (job.parent / "pre").mkdir()
    (job.parent / "pre" / "model.safetensors.index.json").write_text(text)
    return job


@pytest.mark.parametrize(
    "text",
    [
        "[" * 100_000 + "]" * 100_000,
        '{"weight_map": ' + "[" * 50_000 + "]" * 50_000 + "}",
        '{"weight_map": {"fc1.weight": ' + "1" * 5_000 + "}}",  # beyond int()'s digit limit
    ],
    ids=["deep", "deep-in-map", "huge-int"],
)
def test_an_unreadable_weights_index_is_not_valid_json(tmp_path: Path, text: str) -> None:
    with pytest.raises(
        JobError, match=r"^model\.weights: pre/model\.safetensors\.index\.json: not valid JSON"
    ):
        load_job(_with_index(tmp_path, text))


# -- YAML 1.1 integers ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "read"),
    [
        ("1:30", "1:30"),  # 1.1: base 60, 90
        ("12:30:00", "12:30:00"),
        ("1:30.5", "1:30.5"),  # 1.1: the float 90.5
        ("010", 10),  # 1.1: octal 8
        ("-010", -10),
        ("08", 8),
        ("0o10", 8),  # 1.2's octal (1.1: a string)
        ("0x20", 32),
        ("0b101", 5),
        ("1_000", 1000),
        ("0", 0),
        ("+7", 7),
        ("1e-3", 0.001),
        ("-.5", -0.5),  # 1.1: a string
        ("1.", 1.0),
        ("-.inf", float("-inf")),
        ("2020-01-01", "date"),  # untouched: still a date, which the schema refuses where it must
    ],
)
def test_numbers_are_read_as_yaml_1_2_reads_them(value: str, read: object) -> None:
    got = parse_yaml_text(f"a: {value}\n", "job.yaml")["a"]
    if read == "date":
        assert type(got).__name__ == "date"
    else:
        assert got == read and type(got) is type(read)


def test_sexagesimal_steps_are_refused_and_a_leading_zero_is_decimal(tmp_path: Path) -> None:
    job = _copy(tmp_path)
    text = job.read_text()
    job.write_text(text.replace("steps: 20", "steps: 1:30"))
    with pytest.raises(JobError, match=r"^steps: must be an integer \(got '1:30'\)"):
        load_job_spec(job)
    job.write_text(text.replace("seed: 0", "seed: 010"))
    assert load_job_spec(job).seed == 10


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("a: !!int abc\n", "'abc' is not an integer"),
        ("a: !!int 1:30\n", "'1:30' is not an integer"),
        ("a: !!float 1:30\n", "'1:30' is not a number"),
        ("a: !!float abc\n", "'abc' is not a number"),
        ("a: " + "1" * 5_000 + "\n", "is not an integer"),  # beyond int()'s digit limit
    ],
)
def test_numbers_that_are_none_are_yaml_errors_with_the_line(text: str, says: str) -> None:
    with pytest.raises(JobError, match=r"^job\.yaml:1: ") as e:
        parse_yaml_text(text, "job.yaml")
    assert says in str(e.value)


# -- C++ backtraces ------------------------------------------------------------------------------------


def test_a_torch_error_building_the_model_is_one_line_without_backtrace(tmp_path: Path) -> None:
    job = _copy(tmp_path, **{"model.kwargs.hidden": 10**23})
    with pytest.raises(JobError, match=r"^model\.entrypoint: model\.py:build raised TypeError: ") as e:
        load_job(job)
    message = str(e.value)
    assert "Overflow" in message
    assert "\n" not in message and "Exception raised from" not in message and "frame #" not in message
    assert len(message) < 400


def test_short_error_cuts_a_cpp_backtrace() -> None:
    text = (
        "shape mismatch\nException raised from f at x.cpp:1 (most recent call first):\nframe #0: c10::Error"
    )
    assert short_error(RuntimeError(text)) == "RuntimeError: shape mismatch"
    # Also where the backtrace shares the message's line.
    assert (
        short_error(RuntimeError("bad size Exception raised from f frame #0: x")) == "RuntimeError: bad size"
    )
    assert short_error(RuntimeError("Exception raised from f")) == "RuntimeError"
    assert len(short_error(ValueError("x" * 1000))) == len("ValueError: ") + 300
