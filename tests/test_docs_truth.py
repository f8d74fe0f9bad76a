"""What the README and the package maps promise about the code, held to it.

- Each package's ``__init__.py`` has a map of its files (README "Repository map"): every module of the
  package is named there as ``name.py``, and every ``name.py`` the map names is a module of the package.
- README "Commands" has a row for every ``fusionnet`` sub-command.
- README "Repository map" lists every package and top-level module, in the order of pyproject.toml's
  import layers.
- ``fusionnet status --key FILE`` signs its broker call with that file's key (README "Commands": status
  shows your own jobs in full when it can sign), and never makes a key.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from fusionnet.cli import cmd_status
from fusionnet.cli.main import COMMANDS, build_parser, main
from fusionnet.messages.auth import public_bytes, verify_auth
from fusionnet.runtime.submitter import load_or_create_key

REPO = Path(__file__).resolve().parent.parent
PACKAGES = sorted(p.parent for p in (REPO / "fusionnet").glob("*/__init__.py"))
PEER = "/ip4/127.0.0.1/tcp/31337/p2p/QmcEPrat8ShnCph8WjkREzt5CPXF2RwhYxYBALDcLC1iV6"


# ---- package maps --------------------------------------------------------------------------------------
def _package_map(package: Path) -> str:
    return ast.get_docstring(ast.parse((package / "__init__.py").read_text())) or ""


def _modules(package: Path) -> set[str]:
    return {p.stem for p in package.glob("*.py") if p.name != "__init__.py"}


def test_packages_found() -> None:
    names = {p.name for p in PACKAGES}
    assert {"broker", "cli", "dag", "runtime", "serving", "schedules", "wire"} <= names


@pytest.mark.parametrize("package", PACKAGES, ids=lambda p: p.name)
def test_every_module_is_named_in_its_package_map(package: Path) -> None:
    doc = _package_map(package)
    assert doc, f"fusionnet/{package.name}/__init__.py has no docstring (the package's map)"
    named = set(re.findall(r"``(\w+)\.py``", doc))
    missing = sorted(_modules(package) - named)
    assert not missing, (
        f"fusionnet/{package.name}/__init__.py's map does not name {', '.join(m + '.py' for m in missing)} "
        "(add one line each: ``name.py``  what it does)"
    )
    stale = sorted(named - _modules(package))
    assert not stale, (
        f"fusionnet/{package.name}/__init__.py's map names {', '.join(m + '.py' for m in stale)}, "
        "which are not modules of the package (moved or removed?)"
    )


# ---- README "Commands" ----------------------------------------------------------------------------------
def _section(text: str, heading: str) -> str:
    start = text.index(f"\n{heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def _commands_in_table() -> set[str]:
    section = _section((REPO / "README.md").read_text(), "## Commands")
    rows = [line for line in section.splitlines() if line.startswith("| `fusionnet ")]
    return {re.match(r"\| `fusionnet ([a-z0-9-]+)", row).group(1) for row in rows}  # type: ignore[union-attr]


def _subcommands() -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return set(sub.choices)


def test_every_subcommand_is_in_the_commands_table() -> None:
    subcommands = _subcommands()
    assert set(COMMANDS) <= subcommands  # every module of COMMANDS registers its own name
    assert "undeploy" in subcommands  # cmd_deploy registers two
    missing = sorted(subcommands - _commands_in_table())
    assert not missing, f'README "## Commands" has no row for: {", ".join(missing)}'


def test_commands_table_names_only_real_subcommands() -> None:
    unknown = sorted(_commands_in_table() - _subcommands())
    assert not unknown, f'README "## Commands" has rows for commands that do not exist: {unknown}'


@pytest.mark.parametrize("command", ["submit", "cancel", "results", "status", "deploy", "undeploy", "key"])
def test_key_flag_documented_and_accepted(command: str, tmp_path: Path) -> None:
    section = _section((REPO / "README.md").read_text(), "## Commands")
    row = next(line for line in section.splitlines() if line.startswith(f"| `fusionnet {command} "))
    assert "--key FILE" in row.split("|")[1], f"the {command} row does not show --key FILE"
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    assert "--key" in sub.choices[command]._option_string_actions


def test_status_row_documents_wait_compnodes_and_exit_3() -> None:
    section = _section((REPO / "README.md").read_text(), "## Commands")
    row = next(line for line in section.splitlines() if line.startswith("| `fusionnet status "))
    assert "--wait-compnodes N" in row and "exit 3" in row
    source = (REPO / "fusionnet/cli/cmd_status.py").read_text()
    assert "return 3" in source  # the exit code the row documents


# ---- fusionnet status --key -----------------------------------------------------------------------------
def test_status_parser_accepts_key(tmp_path: Path) -> None:
    key_file = tmp_path / "me.key"
    args = build_parser().parse_args(["status", "--initial-peers", PEER, "--key", str(key_file)])
    assert args.key == key_file and args.func is cmd_status.run
    args = build_parser().parse_args(["status", "--initial-peers", PEER])
    assert args.key is None


def test_status_signs_with_the_given_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    given = tmp_path / "given" / "submitter.key"
    default = tmp_path / "default" / "submitter.key"
    given_key, default_key = load_or_create_key(given), load_or_create_key(default)
    monkeypatch.setenv("FUSIONNET_KEY", str(default))  # the default key exists, and is not the one used

    key = cmd_status.status_key(given)
    assert public_bytes(key) == public_bytes(given_key) != public_bytes(default_key)
    observer = SimpleNamespace(peer_id="QmCaller")
    auth = cmd_status._own_jobs_auth(observer, key)("QmBroker")
    assert auth.key == public_bytes(given_key)
    # a valid signature of this status call, by that key
    who = verify_auth(auth, broker="QmBroker", caller="QmCaller", scope="status")
    assert who == public_bytes(given_key).hex()

    # without --key: the default key, when there is one
    assert public_bytes(cmd_status.status_key(None)) == public_bytes(default_key)


def test_status_never_makes_a_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FUSIONNET_KEY", str(tmp_path / "none" / "submitter.key"))
    assert cmd_status.status_key(None) is None  # no default key: unsigned
    assert cmd_status._own_jobs_auth(SimpleNamespace(peer_id="QmCaller"), None) is None
    with pytest.raises(ValueError, match="no such key file"):
        cmd_status.status_key(tmp_path / "missing.key")
    assert not (tmp_path / "none").exists() and not (tmp_path / "missing.key").exists()


def test_status_refuses_a_missing_key_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "missing.key"
    assert main(["status", "--initial-peers", PEER, "--key", str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fusionnet status: error: --key:") and err.count("\n") == 1
    assert not missing.exists()


def test_status_passes_the_key_to_the_broker_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    given = tmp_path / "submitter.key"
    given_key = load_or_create_key(given)
    seen: dict[str, Any] = {}

    async def fake_gather(initial_peers: list[str], timeout: float, key: Any = None) -> dict[str, Any]:
        seen["key"] = key
        return {"broker": None, "broker_error": "none", "compnodes": [], "jobs": [], "deployments": []}

    monkeypatch.setattr(cmd_status, "gather", fake_gather)
    assert main(["status", "--initial-peers", PEER, "--key", str(given), "--json"]) == 1  # no broker
    assert public_bytes(seen["key"]) == public_bytes(given_key)
    assert json.loads(capsys.readouterr().out)["broker"] is None


# ---- README "Repository map" ----------------------------------------------------------------------------
def test_repository_map_follows_the_import_layers() -> None:
    """The map lists fusionnet's packages in the order of pyproject.toml's layers contract, every one."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    layers = next(c for c in config["contracts"] if c["id"] == "layers")["layers"]
    layer_of = {
        name.strip().removeprefix("fusionnet."): i
        for i, layer in enumerate(layers)
        for name in layer.split("|")
    }
    section = _section((REPO / "README.md").read_text(), "## Repository map")
    block = section[section.index("```text") : section.index("```", section.index("```text") + 7)]
    listed = re.findall(r"^  (\w+)(?:/|\.py)\s", block, flags=re.MULTILINE)
    assert set(layer_of) <= set(listed), f"missing from the map: {sorted(set(layer_of) - set(listed))}"
    order = [layer_of[name] for name in listed if name in layer_of]
    assert order == sorted(order), f"the map's order runs up the layers: {listed}"
    packages = {p.name for p in PACKAGES}
    modules = {p.stem for p in (REPO / "fusionnet").glob("*.py") if p.name != "__init__.py"}
    assert packages | modules <= set(listed), f"not in the map: {sorted(packages | modules - set(listed))}"
