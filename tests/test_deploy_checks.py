"""``fusionnet deploy`` checks a job as ``plan``, ``run`` and ``submit`` do before anything leaves this
machine (no swarm: nothing listens at the peer given, and every case is refused before it is dialled):

- its model code is loaded once in a bounded child first (``--load-timeout``): a loop at import, an
  ``os._exit(0)`` or a segfault is one line and exit 2, not a hang, a silent exit 0 or a bare -11, for
  ``task: infer`` and ``task: generate`` alike;
- the tokenizer files it ships lie inside the job folder after symlinks, as every other path of a job
  (interface.md), unless ``--allow-outside-paths``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fusionnet.cli.main import EXIT_BAD_INPUT, build_parser, main
from fusionnet.errors import JobError
from fusionnet.serving.tokenizers import tokenizer_files
from tests.jobfiles import REPO

pytestmark = pytest.mark.timeout(180)

PEER = "/ip4/127.0.0.1/tcp/9/p2p/QmWip7R2pWskGRpMQjNA1qc4Xr169CqMTAtuZn1EC93Zzh"  # nothing listens there
SECRET = "SECRET-OUTSIDE-THE-JOB-FOLDER"

LOOP = "while True:\n    pass\n"
EXIT = "import os\nos._exit(0)\n"
SEGFAULT = "import ctypes\nctypes.string_at(0)\n"


def _copy(tmp: Path, example: str, prefix: str) -> Path:
    """A copy of ``examples/EXAMPLE`` whose model file runs ``prefix`` first when it is imported."""
    job_dir = tmp / "job"
    ignore = shutil.ignore_patterns("__pycache__", ".test-*")
    shutil.copytree(REPO / "examples" / example, job_dir, ignore=ignore)
    model = job_dir / "model.py"
    # a __future__ import must come first: it goes, so that the prefix can (annotations are not run)
    model.write_text(prefix + model.read_text().replace("from __future__ import annotations\n", ""))
    return job_dir


def _mlp_infer(tmp: Path, prefix: str = "") -> Path:
    """examples/mlp as a ``task: infer`` deployment, ``prefix`` run first when its model file is imported."""
    job_dir = _copy(tmp, "mlp", prefix)
    (job_dir / "job.yaml").write_text(
        (job_dir / "job.yaml").read_text().replace("task: train", "task: infer")
    )
    return job_dir / "job.yaml"


def _gpt_generate(tmp: Path, prefix: str = "") -> Path:
    """examples/gpt's ``task: generate`` deployment, ``prefix`` run first when its model file is imported."""
    job_dir = _copy(tmp, "gpt", prefix)
    return job_dir / "generate.yaml"


def _deploy(job: Path, *flags: str) -> tuple[int, float]:
    """``fusionnet deploy`` in this process: its exit code and how long it took."""
    start = time.monotonic()
    code = main(["deploy", str(job), "--initial-peers", PEER, "--wait-compnodes", "1", *flags])
    return code, time.monotonic() - start


def _deploy_in_child(job: Path, *flags: str) -> subprocess.CompletedProcess[str]:
    """``fusionnet deploy`` in a process of its own: were the load check gone again, model code that
    ends or crashes its process would end this test's process, not fail the test."""
    cmd = [sys.executable, "-m", "fusionnet.cli.main", "deploy", str(job), "--initial-peers", PEER]
    cmd += ["--wait-compnodes", "1", *flags]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)


# ---- the load check -------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("prefix", "says"),
    [
        (EXIT, r"ended the process \(exit code 0\) before it was loaded"),
        (SEGFAULT, r"killed the process \(SIGSEGV\)"),
    ],
    ids=["exit", "segfault"],
)
def test_model_code_that_ends_the_process_is_one_line_and_exit_2(
    tmp_path: Path, prefix: str, says: str
) -> None:
    """Before: ``os._exit(0)`` at import ended deploy with exit 0 and nothing deployed, a segfault killed
    it (-11) without a word: deploy loaded the model code in its own process."""
    done = _deploy_in_child(_mlp_infer(tmp_path, prefix), "--load-timeout", "60")
    err = done.stderr.strip().splitlines()
    assert done.returncode == EXIT_BAD_INPUT, (done.returncode, err)
    assert len(err) == 1 and err[0].startswith("fusionnet deploy: error: model.entrypoint: "), err
    assert re.search(says, err[0]), err


def test_model_code_that_loops_at_import_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: deploy hung for good (here: until the test's timeout). In this process: the loop runs
    only in the check's child, which the timeout kills."""
    code, took = _deploy(_mlp_infer(tmp_path, LOOP), "--load-timeout", "10")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT and len(err) == 1, err
    assert err[0].startswith(
        "fusionnet deploy: error: model.entrypoint: loading the job did not finish in 10 s"
    )
    assert took < 90  # 10 s, plus the check's own start (importing torch) on a busy machine


# ``task: generate``: the load check loads it as a deployment (``check_job_loads(deployment=True)``), in a
# check child (called here directly: the model code runs only in that child).
GENERATE_CASES = {
    "loop": (LOOP, 5.0, r"loading the job did not finish in 5 s"),
    "exit": (EXIT, 60.0, r"loading the model ended the process \(exit code 0\) before it was loaded"),
    "segfault": (SEGFAULT, 60.0, r"loading the model killed the process \(SIGSEGV\)"),
    "sys.exit": ("import sys\nsys.exit(0)\n", 60.0, r"model\.py: importing it raised SystemExit: 0"),
}


@pytest.mark.parametrize("case", sorted(GENERATE_CASES))
def test_a_generate_jobs_model_code_is_loaded_in_a_bounded_child(tmp_path: Path, case: str) -> None:
    from fusionnet.runtime.deploy import check_deployment_loads

    prefix, timeout, says = GENERATE_CASES[case]
    job = _gpt_generate(tmp_path, prefix)
    with pytest.raises(JobError, match=rf"^model\.entrypoint: {says}"):
        check_deployment_loads(job, allow_outside_paths=False, timeout=timeout)


def test_a_sound_generate_job_passes_its_load_check(tmp_path: Path) -> None:
    """The child loads the job as a deployment: ``task: generate`` is no refusal there."""
    from fusionnet.runtime.deploy import check_deployment_loads

    check_deployment_loads(_gpt_generate(tmp_path), allow_outside_paths=False, timeout=60)


def test_load_timeout_is_submits_flag() -> None:
    """The same flag, default and help text as ``submit`` (and ``plan``, ``run``); README's two rows of
    deploy's flags list it."""

    def flag(command: str) -> argparse.Action:
        sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
        return sub.choices[command]._option_string_actions["--load-timeout"]

    deploy, submit = flag("deploy"), flag("submit")
    assert (deploy.default, deploy.help, deploy.type) == (submit.default, submit.help, submit.type)
    rows = [
        line for line in (REPO / "README.md").read_text().splitlines() if "`fusionnet deploy JOB.yaml" in line
    ]
    assert len(rows) == 2 and all("[--load-timeout S]" in row for row in rows), rows


# ---- the tokenizer's files stay in the job folder -------------------------------------------------------
def _with_tokenizer_symlink_out(tmp: Path, job_dir: Path) -> None:
    """A tokenizer in the job folder whose ``merges.txt`` is a symlink to a file outside it."""
    outside = tmp / "outside"
    outside.mkdir()
    (outside / "secret.txt").write_text(SECRET + "\n")
    (job_dir / "tokenizer.json").write_text("{}")
    os.symlink(outside / "secret.txt", job_dir / "merges.txt")


def test_a_tokenizer_file_outside_the_job_folder_is_refused(tmp_path: Path) -> None:
    job_dir = tmp_path / "job"
    job_dir.mkdir()
    _with_tokenizer_symlink_out(tmp_path, job_dir)
    with pytest.raises(
        JobError, match=r"^tokenizer: merges\.txt: leads outside the job folder .*--allow-outside"
    ):
        tokenizer_files(job_dir)
    # with the flag it is read, as any other path of the job would be
    files = tokenizer_files(job_dir, allow_outside=True)
    assert files is not None and files["merges.txt"] == (SECRET + "\n").encode()


def test_a_tokenizer_file_symlinked_inside_the_job_folder_is_read(tmp_path: Path) -> None:
    """Inside the job folder a symlink is fine, a weights subfolder's tokenizer included."""
    job_dir, weights = tmp_path / "job", tmp_path / "job" / "weights"
    weights.mkdir(parents=True)
    (job_dir / "merges-shared.txt").write_text("a b\n")
    (weights / "tokenizer.json").write_text("{}")
    os.symlink(job_dir / "merges-shared.txt", weights / "merges.txt")
    files = tokenizer_files(weights, job_folder=job_dir)
    assert files == {"tokenizer.json": b"{}", "merges.txt": b"a b\n"}
    # the weights folder as the job folder: the same symlink now leads out of it, and is named so
    with pytest.raises(JobError, match=r"^tokenizer: merges\.txt: leads outside"):
        tokenizer_files(weights)


def test_deploy_refuses_a_tokenizer_symlink_out_of_the_job_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: deploy read the symlink's target and sent it to the broker, which stored it (exit 0 on a
    swarm). Now: one line naming the file, exit 2, before the model is traced or a peer dialled."""
    job = _gpt_generate(tmp_path)
    _with_tokenizer_symlink_out(tmp_path, job.parent)
    code, _ = _deploy(job)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT, err
    assert len(err) == 1 and err[0].startswith("fusionnet deploy: error: tokenizer: merges.txt: "), err
    assert "leads outside the job folder" in err[0] and SECRET not in err[0], err
