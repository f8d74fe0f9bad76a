"""Reading a hostile job file is bounded: one JobError naming the file (and line), quickly, small."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from fusionnet.errors import JobError
from fusionnet.job.parse import (
    MAX_JOB_FILE_BYTES,
    MAX_YAML_NODES,
    load_job_spec,
    parse_yaml_text,
    spec_from_document,
)

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.timeout(30)


def _laughs(levels: int) -> str:
    """The "billion laughs" document: 9**levels strings from a few hundred bytes of YAML."""
    lines = ['l0: &l0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels):
        refs = ",".join([f"*l{i - 1}"] * 9)
        lines.append(f"l{i}: &l{i} [{refs}]")
    return "\n".join(lines) + "\n"


def _refusal(text: str) -> str:
    start = time.monotonic()
    with pytest.raises(JobError) as info:
        parse_yaml_text(text, "job.yaml")
    assert time.monotonic() - start < 5
    message = str(info.value)
    assert message.startswith("job.yaml"), message
    assert len(message) < 400, message
    return message


def test_deep_nesting_is_refused_with_the_line() -> None:
    assert "nested deeper" in _refusal("name: x\nsteps: " + "[" * 50_000)


@pytest.mark.parametrize("where", ["name: *l8\n", "junk: *l8\n"])
def test_billion_laughs_is_refused_before_it_is_built(where: str) -> None:
    assert "expands to more than" in _refusal(_laughs(9) + where)


def test_a_few_aliases_still_work() -> None:
    assert parse_yaml_text("a: &x [1, 2]\nb: *x\n", "job.yaml") == {"a": [1, 2], "b": [1, 2]}


def test_too_many_values_are_refused() -> None:
    items = ", ".join(["1"] * (MAX_YAML_NODES + 10))
    assert "more than" in _refusal(f"xs: [{items}]\n")


def test_oversized_file_is_refused_without_reading_it(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("# " + "x" * MAX_JOB_FILE_BYTES + "\n")
    with pytest.raises(JobError, match="at most"):
        load_job_spec(job)


@pytest.mark.parametrize("name", ["bad\0name.yaml", "x" * 5000 + ".yaml"])
def test_unusable_paths_give_one_message(tmp_path: Path, name: str) -> None:
    with pytest.raises(JobError) as info:
        load_job_spec(tmp_path / name)
    assert len(str(info.value)) < 300


def test_huge_values_are_quoted_short(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("name: [" + ", ".join(["123456789"] * 5000) + "]\ntask: train\n")
    with pytest.raises(JobError) as info:
        load_job_spec(job)
    assert str(info.value).startswith("name:")
    assert len(str(info.value)) < 600


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("name", "x" * 100_000, "name: must be at most 200 characters"),
        ("steps", 10**9, "steps: must be <= 10000000"),
        ("placement.compnodes", 10**6, "placement.compnodes: must be <= 1024"),
        ("data.batch_size", 10**9, "data.batch_size: must be <= 16777216"),
        ("data.microbatches", 10**6, "data.microbatches: must be <= 65536"),
        ("optimizer.lr", 1e300, "optimizer.lr: must be <= 1e+30"),
    ],
)
def test_numbers_and_names_have_the_wires_limits(key: str, value: object, message: str) -> None:
    """The job file refuses what the broker's RunSpec would refuse, before anything is allocated."""
    doc = yaml.safe_load((REPO / "examples" / "mlp" / "job.yaml").read_text())
    section, _, field = key.rpartition(".")
    (doc.setdefault(section, {}) if section else doc)[field] = value
    with pytest.raises(JobError) as info:
        spec_from_document(doc, "job.yaml")
    assert str(info.value).startswith(message), str(info.value)
    assert len(str(info.value)) < 300
