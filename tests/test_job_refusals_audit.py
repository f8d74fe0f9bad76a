"""Refusals an audit found missing or wrong: each is bad input (exit 2, one line that starts with the key
or file at fault), found before anything runs, never an internal error, a wrong key or a lost result.

Job folders are copies of ``examples/`` with one thing changed. Most checks call the loader, the tracer
or the nodes-file reader directly; a few go through ``fusionnet.cli.main`` to pin the exit code and the
one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from safetensors.torch import save_file

from fusionnet.cli.jobflags import check_output_dir
from fusionnet.cli.main import BAD_INPUT, EXIT_BAD_INPUT, main
from fusionnet.errors import ComputeError, JobError, PlanError, TraceError
from fusionnet.job.loader import load_job, load_job_spec
from fusionnet.perfmodel.nodes import load_nodes_file
from fusionnet.runtime.prepare import prepare_job, trace_job

REPO = Path(__file__).resolve().parent.parent
MLP = REPO / "examples" / "mlp"
GPT = REPO / "examples" / "gpt"

pytestmark = pytest.mark.timeout(120)

NODES = "nodes:\n  - {name: box, kind: cpu, peak_flops: 50G, mem_bandwidth: 20GB/s, d_cpu: 8GiB, count: 2}\n"


def _copy(example: Path, tmp: Path, **keys: Any) -> Path:
    """``example`` copied to ``tmp/job`` with dotted ``keys`` set in its job.yaml (None deletes)."""
    folder = tmp / "job"
    shutil.copytree(example, folder, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    job = folder / "job.yaml"
    doc = yaml.safe_load(job.read_text())
    for dotted, value in keys.items():
        *parents, last = dotted.split(".")
        node = doc
        for part in parents:
            node = node.setdefault(part, {})
        if value is None:
            node.pop(last, None)
        else:
            node[last] = value
    job.write_text(yaml.safe_dump(doc, sort_keys=False))
    return job


def _with_model(tmp: Path, source: str, **keys: Any) -> Path:
    """The MLP example with its model replaced by ``source`` (``build()`` takes no arguments)."""
    job = _copy(MLP, tmp, **{"model.kwargs": {}, **keys})
    (job.parent / "model.py").write_text(source)
    return job


def _one_line(capsys: pytest.CaptureFixture[str], command: str, starts: str) -> str:
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert err[0].startswith(f"fusionnet {command}: error: {starts}"), err
    assert "internal error" not in err[0]
    return err[0]


# -- 1. a model that fails on a whole micro-batch, or in train mode ------------------------------------

VIEW_ONE_ROW = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        return self.fc(x.view(1, 16))

def build():
    return M()
"""

RAISES_IN_TRAINING = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 4)

    def forward(self, x):
        if self.training:
            raise RuntimeError("boom in training mode")
        return self.fc(x)

def build():
    return M()
"""


def test_model_failing_on_a_whole_microbatch_is_bad_input(tmp_path: Path, capsys) -> None:
    job = _with_model(tmp_path, VIEW_ONE_ROW)
    out = tmp_path / "out"
    assert main(["run", str(job), "--local", "2", "--output", str(out), "--no-predict"]) == EXIT_BAD_INPUT
    line = _one_line(capsys, "run", "model.entrypoint: model.py:build: ")
    assert "RuntimeError: shape '[1, 16]' is invalid" in line and "train mode" in line


def test_model_failing_in_train_mode_names_the_entrypoint(tmp_path: Path) -> None:
    job = load_job(_with_model(tmp_path, RAISES_IN_TRAINING))
    with pytest.raises(TraceError, match=r"^model\.entrypoint: model\.py:build: .*boom in training mode"):
        trace_job(job)


def test_vocabulary_smaller_than_the_corpus_names_model_kwargs(tmp_path: Path) -> None:
    # 41 distinct characters in the corpus: an embedding of 40 rows passes the one-row preflight (the
    # first sample lacks the last character) and fails on the first micro-batch.
    kwargs = {"vocab_size": 40, "block_size": 32, "n_layer": 2, "d_model": 64, "n_head": 4}
    job = load_job(_copy(GPT, tmp_path, **{"model.kwargs": kwargs, "data.batch_size": 4}))
    with pytest.raises(TraceError, match=r"^model\.kwargs: .*IndexError.*token ids up to 40.*40 rows"):
        trace_job(job)


# -- 2. an untraceable model is one line, torch's logging and graph dumps silenced -----------------------

DATA_DEPENDENT_IF = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        h = self.fc1(x)
        if h.sum() > 0:
            h = torch.relu(h)
        return self.fc2(h)

def build():
    return M()
"""


def test_untraceable_model_is_one_line_naming_the_entrypoint(tmp_path: Path, capfd) -> None:
    job = _with_model(tmp_path, DATA_DEPENDENT_IF)
    nodes = tmp_path / "nodes.yaml"
    nodes.write_text(NODES)
    assert main(["plan", str(job), "--nodes", str(nodes)]) == EXIT_BAD_INPUT
    captured = capfd.readouterr()  # fd level: torch's own handlers and prints, the load-check child
    err = [line for line in captured.err.splitlines() if line.strip()]
    assert len(err) == 1, captured.err[:3000]
    assert err[0].startswith(
        "fusionnet plan: error: model.entrypoint: model.py:build: model cannot be traced"
    )


# -- 3. more sub-DAGs than ops ----------------------------------------------------------------------------


def test_local_with_more_compnodes_than_ops_names_local(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    job = MLP / "job.yaml"
    assert main(["run", str(job), "--local", "12", "--output", str(out), "--no-predict"]) == EXIT_BAD_INPUT
    line = _one_line(capsys, "run", "--local: 12 compnode(s) make 12 sub-DAGs")
    assert "only 6 ops" in line and not out.exists()


def test_interleaved_chunks_times_compnodes_beyond_ops_names_placement(tmp_path: Path) -> None:
    job = load_job(
        _copy(
            MLP,
            tmp_path,
            **{"placement.compnodes": 4, "placement.schedule": "interleaved-1f1b", "data.microbatches": 4},
        )
    )
    with pytest.raises(
        JobError, match=r"^placement\.compnodes: 4 compnode\(s\) x placement\.chunks 2 make 8"
    ):
        trace_job(job)
    with pytest.raises(JobError, match=r"^--local: 4 compnode\(s\) x placement\.chunks 2"):
        prepare_job(job, 4)


# -- 4. run --local exits as submit does for the same input error ------------------------------------------


def test_run_treats_the_brokers_input_errors_as_bad_input() -> None:
    from fusionnet.broker.jobrun import INPUT_ERRORS

    assert set(BAD_INPUT) == set(INPUT_ERRORS)


def test_compute_error_in_run_is_exit_2(tmp_path: Path, monkeypatch, capsys) -> None:
    import fusionnet.cli.cmd_run as cmd_run

    def fails(args: Any) -> int:
        raise ComputeError("op linear_1 of sub-DAG 1 raised IndexError: index out of range")

    monkeypatch.setattr(cmd_run, "run", fails)
    code = main(["run", str(MLP / "job.yaml"), "--local", "2", "--output", str(tmp_path / "o")])
    assert code == EXIT_BAD_INPUT
    _one_line(capsys, "run", "op linear_1")


# -- 5. precision checked by the preflight ----------------------------------------------------------------

SCATTER_MIXED_DTYPES = """
import torch
from torch import nn

class M(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)
        self.fc2 = nn.Linear(16, 4)

    def forward(self, x):
        h = self.fc(x)
        idx = torch.arange(16).expand(x.shape[0], 16)
        return self.fc2(torch.zeros_like(x).scatter(1, idx, h))

def build():
    return M()
"""


def test_op_failing_under_bf16_autocast_names_precision(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"^precision: bf16: .*scatter"):
        load_job(_with_model(tmp_path / "bf16", SCATTER_MIXED_DTYPES, precision="bf16"))
    load_job(_with_model(tmp_path / "fp32", SCATTER_MIXED_DTYPES))  # the same model in fp32 is fine


# -- 6. a result file's name taken by a directory ----------------------------------------------------------


@pytest.mark.parametrize("entry", ["weights.safetensors", "metrics.jsonl", "plan.json.tmp"])
def test_output_with_a_directory_where_a_result_goes_is_refused(tmp_path: Path, entry: str) -> None:
    (tmp_path / "out" / entry).mkdir(parents=True)
    with pytest.raises(JobError, match=rf"^--output: .*/{entry} is a directory"):
        check_output_dir(tmp_path / "out")


def test_run_refuses_such_an_output_before_running(tmp_path: Path, capsys) -> None:
    (tmp_path / "out" / "weights.safetensors").mkdir(parents=True)
    args = ["run", str(MLP / "job.yaml"), "--local", "2", "--output", str(tmp_path / "out")]
    assert main(args) == EXIT_BAD_INPUT
    _one_line(capsys, "run", "--output: ")


# -- 7. --load-timeout ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", ["nan", "inf", "0", "-1"])
def test_load_timeout_must_be_positive_and_finite(value: str, capsys) -> None:
    with pytest.raises(SystemExit) as stop:
        main(["plan", str(MLP / "job.yaml"), f"--load-timeout={value}"])
    assert stop.value.code == EXIT_BAD_INPUT
    assert "--load-timeout" in capsys.readouterr().err


# -- 8. plan --nodes: the nodes file is bad input, its counts bounded --------------------------------------


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("nodes:\n  - device: RTX 9999\n", r"nodes\[0\]\.device: device 'RTX 9999' is not in the catalog"),
        ("nodes: [\n", r"nodes file is not valid YAML: line 2"),
        ("nodes:\n  - device: RTX 3080\n    count: -2\n", r"nodes\[0\]\.count must be a positive integer"),
        ("nodes:\n  - device: RTX 3080\n    count: 100000000\n", r"nodes\[0\]\.count must be at most 10000"),
        (
            "nodes:\n  - device: RTX 3080\n    speed_factor: .nan\n",
            r"nodes\[0\]\.speed_factor must be a positive fin",
        ),
        (
            "nodes:\n  - {name: l, kind: cpu, peak_flops: .inf, mem_bandwidth: 1GB/s, d_cpu: 1GiB}\n",
            r"nodes\[0\]\.peak_flops must be a finite number",
        ),
        ("nodes:\n" + "  - {device: RTX 3080, count: 6000}\n" * 2, r"add up to more than 10000 devices"),
    ],
)
def test_nodes_file_errors_are_bad_input_naming_file_and_key(tmp_path: Path, text: str, says: str) -> None:
    path = tmp_path / "nodes.yaml"
    path.write_text(text)
    with pytest.raises(JobError, match=says) as info:
        load_nodes_file(path)
    assert str(info.value).startswith(f"{path}: ")
    assert isinstance(info.value, PlanError)  # still what the planner's callers catch


def test_missing_nodes_file_is_bad_input(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "absent.yaml"
    with pytest.raises(JobError, match=r"cannot read nodes file"):
        load_nodes_file(missing)
    assert main(["plan", str(MLP / "job.yaml"), "--nodes", str(missing)]) == EXIT_BAD_INPUT
    _one_line(capsys, "plan", f"{missing}: cannot read nodes file")


# -- 9, 10. non-finite (or meaningless) optimizer and loss arguments ----------------------------------------


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"optimizer.kwargs": {"momentum": float("nan")}}, r"^optimizer\.kwargs\.momentum: must be a finite"),
        ({"optimizer.kwargs": {"momentum": 1e300}}, r"^optimizer\.kwargs\.momentum: must lie in \[0, 1\)"),
        (
            {"optimizer.kwargs": {"weight_decay": float("inf")}},
            r"^optimizer\.kwargs\.weight_decay: must be a fin",
        ),
        (
            {"optimizer.name": "adam", "optimizer.kwargs": {"betas": [0.9, float("nan")]}},
            r"^optimizer\.kwargs\.betas: must be a finite number",
        ),
        (
            {"optimizer.per_op": {"fc1.*": {"kwargs": {"momentum": float("nan")}}}},
            r"^optimizer\.per_op\.fc1\.\*\.kwargs\.momentum: must be a finite",
        ),
        (
            {"loss.kwargs": {"label_smoothing": float("nan")}},
            r"^loss\.kwargs\.label_smoothing: must be a finite",
        ),
    ],
)
def test_nonfinite_kwargs_are_refused_by_name(tmp_path: Path, keys: dict[str, Any], says: str) -> None:
    with pytest.raises(JobError, match=says):
        load_job_spec(_copy(MLP, tmp_path, **keys))


# -- 11, 12. the weights folder: a symlink loop, an index that leads outside ---------------------------------


def _weights_folder(tmp: Path, index_map: dict[str, str]) -> Path:
    """The MLP example with ``model.weights: pre``: a save_pretrained folder with the given index."""
    job = _copy(MLP, tmp, **{"model.weights": "pre"})
    pre = job.parent / "pre"
    pre.mkdir()
    state = load_job(MLP / "job.yaml").model.state_dict()
    save_file(state, str(pre / "model-00001-of-00001.safetensors"))
    (pre / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index_map}))
    return job


def test_symlink_loop_in_the_weights_folder_names_model_weights(tmp_path: Path) -> None:
    state = load_job(MLP / "job.yaml").model.state_dict()
    job = _weights_folder(
        tmp_path, {k: "model-00001-of-00001.safetensors" for k in state} | {"fc1.weight": "loop"}
    )
    (job.parent / "pre" / "loop").symlink_to("loop")
    with pytest.raises(
        JobError, match=r"^model\.weights: pre/model\.safetensors\.index\.json: 'loop' is not a usable"
    ):
        load_job(job)


def test_weights_index_leading_outside_is_refused(tmp_path: Path) -> None:
    state = load_job(MLP / "job.yaml").model.state_dict()
    job = _weights_folder(tmp_path, {k: "model-00001-of-00001.safetensors" for k in state})
    index = job.parent / "pre" / "model.safetensors.index.json"
    outside = tmp_path / "outside_index.json"
    index.rename(outside)
    index.symlink_to(outside)
    with pytest.raises(
        JobError, match=r"^model\.weights: pre/model\.safetensors\.index\.json: .* lies outside the folder"
    ):
        load_job(job)


# -- 13. numeric keys are strict: a quoted learning rate is refused as a quoted batch size is ---------------


@pytest.mark.parametrize(
    ("keys", "says"),
    [
        ({"optimizer.lr": "0.1"}, r"^optimizer\.lr: must be a number \(got '0\.1'\)"),
        (
            {"optimizer.per_op": {"fc1.*": {"lr": "0.1"}}},
            r"^optimizer\.per_op\.fc1\.\*\.lr: must be a number",
        ),
        ({"optimizer.lr": True}, r"^optimizer\.lr: must be a number"),
        ({"data.batch_size": "8"}, r"^data\.batch_size: must be an integer"),
    ],
)
def test_quoted_numbers_are_refused(tmp_path: Path, keys: dict[str, Any], says: str) -> None:
    with pytest.raises(JobError, match=says):
        load_job_spec(_copy(MLP, tmp_path, **keys))


def test_integer_learning_rate_is_still_a_number(tmp_path: Path) -> None:
    spec = load_job_spec(_copy(MLP, tmp_path, **{"optimizer.lr": 1}))
    assert spec.optimizer is not None and spec.optimizer.lr == 1.0


# -- 14. plan --json leaves no folders behind when the job is refused --------------------------------------


def test_plan_json_folders_are_removed_when_the_job_is_refused(tmp_path: Path, capsys) -> None:
    job = _copy(MLP, tmp_path, **{"optimizer.lr": "0.1"})
    target = tmp_path / "new" / "a" / "b" / "plan.json"
    assert main(["plan", str(job), "--json", str(target)]) == EXIT_BAD_INPUT
    _one_line(capsys, "plan", "optimizer.lr: ")
    assert not (tmp_path / "new").exists()


# -- 15. list positions in key paths are written [i], as the graph errors and the README write them -------


def test_schema_errors_write_list_positions_in_brackets(tmp_path: Path) -> None:
    with pytest.raises(JobError, match=r"^placement\.cuts\[0\]: must be a string \(got 3\)"):
        load_job_spec(_copy(MLP, tmp_path, **{"placement.cuts": [3]}))


def test_integer_mapping_keys_are_not_taken_for_list_positions(tmp_path: Path) -> None:
    job = _copy(MLP, tmp_path)
    job.write_text(job.read_text() + "5: 3\n")
    with pytest.raises(JobError, match=r"^5: "):
        load_job_spec(job)


def test_nothing_else_changed_for_a_good_job() -> None:
    # The example still loads and prepares: none of the new checks refuses what was fine.
    job = load_job(MLP / "job.yaml")
    assert len(prepare_job(job, 2).partition.subdags) == 2
    assert torch.isfinite(job.inputs).all()
