"""Model code that misbehaves while loading ends the command with one line and exit code 2: it cannot
hang the command, end it silently with exit 0, or crash it with a traceback."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from fusionnet.cli.main import EXIT_BAD_INPUT, main

REPO = Path(__file__).resolve().parent.parent
MLP = REPO / "examples" / "mlp"

pytestmark = pytest.mark.timeout(120)

BUILD = "\n\ndef build(**kwargs):\n    from torch import nn\n    return nn.Linear(4, 3)\n"

CASES = {
    "loops at import": ("while True:\n    pass\n" + BUILD, r"did not finish in 10 s"),
    "sys.exit(0) at import": ("import sys\nsys.exit(0)\n" + BUILD, r"importing it raised SystemExit: 0"),
    "os._exit at import": ("import os\nos._exit(0)\n" + BUILD, r"ended the process \(exit code 0\)"),
    "segfault at import": ("import ctypes\nctypes.string_at(0)\n" + BUILD, r"killed the process \(SIGSEGV\)"),
    "sys.exit in builder": ("def build(**kwargs):\n    raise SystemExit(3)\n", r"raised SystemExit: 3"),
    "returns a string": (
        "def build(**kwargs):\n    return 'net'\n",
        r"returned str, not a torch\.nn\.Module",
    ),
}


def _job_with_model(tmp: Path, source: str) -> Path:
    job_dir = tmp / "job"
    shutil.copytree(MLP, job_dir, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    (job_dir / "model.py").write_text(source)
    return job_dir / "job.yaml"


# Every case through ``plan``; ``run`` shares the loading code, so two cases show it is wired there too.
MATRIX = [("plan", case) for case in sorted(CASES)] + [
    ("run", "loops at import"),
    ("run", "sys.exit(0) at import"),
]


@pytest.mark.parametrize(("command", "case"), MATRIX)
def test_misbehaving_model_code_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    source, message = CASES[case]
    job = _job_with_model(tmp_path, source)
    extra = ["--local", "2", "--output", str(tmp_path / "out")] if command == "run" else []
    # The child imports torch first (a few seconds on a busy 2-core machine): only the loop may time out.
    limit = "10" if case == "loops at import" else "60"
    start = time.monotonic()
    code = main([command, str(job), "--load-timeout", limit, *extra])
    assert time.monotonic() - start < 70
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT, err
    last = err[-1]
    assert last.startswith(f"fusionnet {command}: error: model.entrypoint: "), err
    assert re.search(message, last), last
    assert "Traceback" not in "\n".join(err)


def test_output_that_is_a_file_is_refused_before_running(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    out.write_text("not a folder")
    code = main(["run", str(MLP / "job.yaml"), "--local", "2", "--output", str(out)])
    assert code == EXIT_BAD_INPUT
    assert (
        capsys.readouterr().err.strip()
        == f"fusionnet run: error: --output: {out} exists and is not a directory"
    )


def test_a_job_refused_after_the_output_check_leaves_no_empty_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--output`` is checked first (writable, or can be made), but the folders made for the check go
    again: the job refused next (here its model cannot be loaded) leaves nothing behind."""
    job = _job_with_model(tmp_path, "raise RuntimeError('broken model file')\n")
    out = tmp_path / "new" / "out"
    assert main(["run", str(job), "--local", "2", "--output", str(out)]) == EXIT_BAD_INPUT
    assert "broken model file" in capsys.readouterr().err and not (tmp_path / "new").exists()


def test_a_sound_job_still_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    job = _job_with_model(tmp_path, (MLP / "model.py").read_text())
    assert (
        main(["run", str(job), "--local", "2", "--output", str(tmp_path / "out"), "--quiet", "--no-predict"])
        == 0
    )
    assert (tmp_path / "out" / "weights.safetensors").exists()


PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmWip7R2pWskGRpMQjNA1qc4Xr169CqMTAtuZn1EC93Zzh"  # nothing listens there


def _mlp_as(tmp: Path, task: str, name: str) -> Path:
    job_dir = tmp / "job"
    shutil.copytree(MLP, job_dir, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    text = (job_dir / "job.yaml").read_text().replace("task: train", f"task: {task}")
    (job_dir / "job.yaml").write_text(text.replace("name: mlp", f"name: {name}"))
    return job_dir / "job.yaml"


@pytest.mark.parametrize(
    ("task", "name", "flags", "says"),
    [
        ("infer", "mlp", ["--initial-peers", "not-an-address"], "--initial-peers: 'not-an-address'"),
        ("train", "mlp", ["--initial-peers", PEER], "a deployment's task is infer or generate, not 'train'"),
        ("infer", "my model", ["--initial-peers", PEER], "give one with --name"),
        ("infer", "mlp", ["--initial-peers", PEER, "--max-wait-ms", "-1"], "--max-wait-ms: "),
        ("infer", "mlp", ["--initial-peers", PEER, "--queue-limit", "0"], "--queue-limit: "),
        ("infer", "mlp", ["--initial-peers", PEER, "--kv-slots", "5000"], "--kv-slots: "),
    ],
)
def test_deploy_refuses_what_it_can_tell_wrong_before_it_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], task: str, name: str, flags: list[str], says: str
) -> None:
    """Bad flags, a job of the wrong task or name, a mistyped address: one line, exit 2, at once (before the
    model is traced, shipped and compnodes waited for), not an internal error with exit 1."""
    start = time.monotonic()
    code = main(["deploy", str(_mlp_as(tmp_path, task, name)), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and len(err) == 1 and err[0].startswith("fusionnet deploy: error: "), err
    assert says in err[0] and "internal error" not in err[0], err
    assert time.monotonic() - start < 10


def test_undeploy_and_deploy_waits_refuse_bad_input_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["undeploy", "mlp", "--initial-peers", "not-an-address"]) == EXIT_BAD_INPUT
    assert "--initial-peers: 'not-an-address'" in capsys.readouterr().err
    with pytest.raises(SystemExit) as stop:  # argparse: a wait that could never end
        main(["deploy", str(MLP / "job.yaml"), "--initial-peers", PEER, "--wait-compnodes", "nan"])
    assert stop.value.code == EXIT_BAD_INPUT and "seconds, a number >= 0" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv",
    [
        ["submit", str(MLP / "job.yaml"), "--output", "OUT"],
        ["cancel", "0123456789ab"],
        ["results", "0123456789ab", "--output", "OUT"],
        ["status"],
    ],
)
def test_a_mistyped_initial_peer_is_one_line_and_exit_2_before_anything_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    """Every command checks ``--initial-peers`` first: ``submit`` no longer traces the job to find out,
    and none of them calls it an internal error (exit 1)."""
    argv = [a.replace("OUT", str(tmp_path / "out")) for a in argv]
    start = time.monotonic()
    code = main([*argv, "--initial-peers", "garbage"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and len(err) == 1, err
    said = f"fusionnet {argv[0]}: error: --initial-peers: 'garbage' is not a multiaddr"
    assert err[0].startswith(said), err
    assert time.monotonic() - start < 5 and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["submit", str(MLP / "job.yaml"), "--output", "out", "--timeout", "-1"], "a number > 0"),
        (["submit", str(MLP / "job.yaml"), "--output", "out", "--timeout", "nan"], "a number > 0"),
        (["submit", str(MLP / "job.yaml"), "--output", "out", "--wait-compnodes", "nan"], "a number >= 0"),
        (["status", "--interval", "0"], "a number > 0"),
        (["status", "--timeout", "inf"], "a number > 0"),
    ],
)
def test_durations_that_cannot_be_waited_out_are_refused_by_the_parser(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    """``nan`` compares false with every deadline (a wait without end); a limit of -1 s submitted the job
    only to cancel it at once."""
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--initial-peers", PEER])
    assert stop.value.code == EXIT_BAD_INPUT and says in capsys.readouterr().err
