"""Model code that misbehaves only on a whole micro-batch (``x.shape[0] > 1``), which the one-row preflight
never ran: the load check's child runs the forward on the job's first micro-batch too, under
``--load-timeout``, so an exit, a hang or a crash there is one line and exit code 2, not a command that
ended with status 0 having done nothing, or that hung past the limit. A ``sys.exit`` the model code makes
in the command's own process (under tracing only) is one line and exit code 2 as well."""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path

import pytest

from fusionnet.cli.main import EXIT_BAD_INPUT, main
from fusionnet.errors import JobError
from fusionnet.runtime import loadcheck

REPO = Path(__file__).resolve().parent.parent
MLP = REPO / "examples" / "mlp"

pytestmark = pytest.mark.timeout(180)

MODEL = """
import ctypes, os, sys, time
import torch
from torch import nn

class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(16, 32)
        self.fc2 = nn.Linear(32, 4)

    def forward(self, x):
        if WHEN:
            BODY
        return self.fc2(torch.relu(self.fc1(x)))

def build(**kwargs):
    return MLP()
"""

ON_BATCH = "x.shape[0] > 1"
IN_FORWARD = r"the model's forward on the first micro-batch \(inputs \(16, 16\), labels \(16,\)\)"
FORWARD = r"model\.entrypoint: " + IN_FORWARD
CASES = {
    "sleeps": ("time.sleep(600)", FORWARD + r" did not finish in 10 s"),
    "sys.exit(0)": (
        "sys.exit(0)",
        r"model\.entrypoint: the model code called sys\.exit\(0\) in " + IN_FORWARD,
    ),
    "os._exit(0)": ("os._exit(0)", FORWARD + r" ended the process \(exit code 0\)"),
    "segfaults": ("ctypes.string_at(0)", FORWARD + r" killed the process \(SIGSEGV\)"),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", FORWARD + r" raised KeyboardInterrupt$"),
}


def _job(tmp: Path, body: str, when: str = ON_BATCH) -> Path:
    folder = tmp / "job"
    shutil.copytree(MLP, folder, ignore=shutil.ignore_patterns("__pycache__", ".test-*"))
    (folder / "model.py").write_text(MODEL.replace("WHEN", when).replace("BODY", body))
    return folder / "job.yaml"


def _command(command: str, job: Path, tmp: Path, limit: str) -> list[str]:
    extra = ["--local", "2", "--output", str(tmp / "out"), "--no-predict"] if command == "run" else []
    return [command, str(job), "--load-timeout", limit, *extra]


MATRIX = [("plan", case) for case in sorted(CASES)] + [("run", "sys.exit(0)"), ("run", "sleeps")]


@pytest.mark.parametrize(("command", "case"), MATRIX)
def test_model_code_misbehaving_on_a_whole_micro_batch_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    body, message = CASES[case]
    job = _job(tmp_path, body)
    start = time.monotonic()
    code = main(_command(command, job, tmp_path, "10" if case == "sleeps" else "60"))
    assert time.monotonic() - start < 90
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert code == EXIT_BAD_INPUT, err
    assert len(err) == 1, err
    assert err[0].startswith(f"fusionnet {command}: error: model.entrypoint: "), err
    assert re.search(message, err[0]), err[0]
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_the_check_runs_the_forward_in_the_jobs_mode(tmp_path: Path) -> None:
    """Tracing runs a train job's forward in train mode: code that exits only there is caught too."""
    job = _job(tmp_path, "sys.exit(0)", when="self.training")
    with pytest.raises(
        JobError, match=r"called sys\.exit\(0\) in the model's forward on the first micro-batch"
    ):
        loadcheck.check_job_loads(job, allow_outside_paths=False)


def test_an_exception_in_the_forward_is_left_to_the_trace_to_say(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The check passes a forward that raises: the command's trace says what failed, with its context."""
    job = _job(tmp_path, "raise ValueError('too many rows')")
    loadcheck.check_job_loads(job, allow_outside_paths=False)
    assert main(["plan", str(job)]) == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1, err
    assert (
        "model.entrypoint: model.py:build: the model's forward with its loss on the first micro-batch"
        in err[0]
    )
    assert "ValueError: too many rows" in err[0]


def test_a_sys_exit_under_tracing_in_the_command_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Code the check's eager forward cannot reach (it exits only while torch.fx traces it) runs in the
    command's own process: its SystemExit is an error with exit 2, not the command's end with status 0."""
    job = _job(tmp_path, "sys.exit(0)", when="torch.fx._symbolic_trace.is_fx_tracing()")
    assert main(["plan", str(job)]) == EXIT_BAD_INPUT
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert err == [
        "fusionnet plan: error: model.entrypoint: the model code called sys.exit(0) while the command ran it"
    ]


def test_help_and_usage_errors_still_exit_as_argparse_does(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as helped:
        main(["plan", "--help"])
    assert helped.value.code == 0
    with pytest.raises(SystemExit) as usage:
        main(["plan"])
    assert usage.value.code == 2
    assert "the following arguments are required: job" in capsys.readouterr().err


def test_a_command_without_a_job_keeps_its_system_exit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only a command that runs a job's model code maps SystemExit; others (daemons) exit as they asked."""
    from fusionnet.cli import cmd_key

    def exits(args: object) -> int:
        raise SystemExit(5)

    monkeypatch.setattr(cmd_key, "run", exits)
    with pytest.raises(SystemExit) as ended:
        main(["key"])
    assert ended.value.code == 5
