"""A ``--key FILE`` that is no submitter key (garbage, a directory, a file where its folder should be) is
bad input for every command that signs: one line naming ``--key`` and the file, exit 2, before anything is
dialled. It used to be "internal error ValueError/IsADirectoryError", exit 1, for all but ``status``."""

from __future__ import annotations

from pathlib import Path

import pytest

from fusionnet.cli.main import EXIT_BAD_INPUT, main

pytestmark = pytest.mark.timeout(120)
REPO = Path(__file__).resolve().parent.parent
# a well-formed address nobody listens on: each command must fail on the key before it dials
PEER = "/ip4/127.0.0.1/tcp/1/p2p/QmTm1fBrRE6MQs363HM3ombBu1XAi3tvEY2ypsDqecKh21"


def _argv(command: str, out: Path) -> list[str]:
    peers = ["--initial-peers", PEER]
    return {
        "key": ["key"],
        "status": ["status", *peers],
        "cancel": ["cancel", "abc", *peers],
        "results": ["results", "abc", *peers, "--output", str(out)],
        "undeploy": ["undeploy", "abc", *peers],
        "submit": ["submit", str(REPO / "examples/mlp/job.yaml"), *peers, "--output", str(out)],
        "deploy": ["deploy", str(REPO / "examples/mlp/infer.yaml"), *peers, "--wait-compnodes", "0"],
    }[command]


def _bad_keys(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """Kind -> (the --key path, what the error says of it)."""
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"short")
    folder = tmp_path / "folder.key"
    folder.mkdir()
    (tmp_path / "plain").write_text("a file, not a folder")
    return {
        "garbage": (garbage, "not a FusionNet submitter key (32 bytes expected, got 5)"),
        "directory": (folder, "is a directory, not a key file"),
        "under a file": (
            tmp_path / "plain" / "x.key",
            f"cannot create it ({tmp_path / 'plain'} is not a directory)",
        ),
    }


CHEAP = ["key", "status", "cancel", "results", "undeploy"]
# submit and deploy check (and deploy traces) the job's model first: seconds each, so garbage only
MATRIX = [(c, kind) for c in CHEAP for kind in ("garbage", "directory", "under a file")]
MATRIX += [("submit", "garbage"), ("deploy", "garbage")]


@pytest.mark.parametrize(("command", "kind"), MATRIX)
def test_a_bad_key_file_is_one_line_and_exit_2(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    command: str,
    kind: str,
) -> None:
    monkeypatch.setenv("FUSIONNET_HOME", str(tmp_path / "home"))  # never this user's own key
    monkeypatch.delenv("FUSIONNET_KEY", raising=False)
    path, what = _bad_keys(tmp_path)[kind]
    said = f"--key {path}: {what}"
    if command == "status" and kind == "under a file":
        said = f"--key: {path}: no such key file"  # status never makes a key: it says so before trying
    code = main([*_argv(command, tmp_path / "out"), "--key", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == EXIT_BAD_INPUT, err
    assert err[-1].startswith(f"fusionnet {command}: error: {said}"), err
    assert "internal error" not in "\n".join(err) and "Traceback" not in "\n".join(err)


def test_a_bad_default_key_is_named_by_where_it_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    garbage = tmp_path / "garbage.key"
    garbage.write_bytes(b"short")
    monkeypatch.setenv("FUSIONNET_KEY", str(garbage))
    assert main(["key"]) == EXIT_BAD_INPUT
    said = capsys.readouterr().err.strip().splitlines()[-1]
    assert said.startswith(f"fusionnet key: error: $FUSIONNET_KEY {garbage}: not a FusionNet submitter key")
    monkeypatch.delenv("FUSIONNET_KEY")
    monkeypatch.setenv("FUSIONNET_HOME", str(tmp_path / "home"))
    (tmp_path / "home" / "submitter.key").mkdir(parents=True)
    assert main(["key"]) == EXIT_BAD_INPUT
    said = capsys.readouterr().err.strip().splitlines()[-1]
    home_key = tmp_path / "home" / "submitter.key"
    assert said == f"fusionnet key: error: submitter key {home_key}: is a directory, not a key file"
