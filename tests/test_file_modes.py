"""Hygiene (issue 12, deliver 6): state folders 0700 and files 0600 from creation, whatever the umask."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fusionnet.broker.checkpoints import Checkpoint, JobFiles
from fusionnet.daemon.files import StateDir, apply_private_umask
from fusionnet.dht.identity import load_or_create_identity, owner_peer_id, peer_id_of, write_private


def _mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def open_umask() -> Iterator[None]:
    """The worst case an operator can have: umask 0 (everything world-writable unless we say so)."""
    old = os.umask(0)
    try:
        yield
    finally:
        os.umask(old)


def test_state_dir_is_0700_from_creation_and_an_old_open_one_is_restricted(
    tmp_path: Path, open_umask
) -> None:
    fresh = StateDir(tmp_path / "a" / "state", "broker")
    fresh.acquire()
    try:
        assert _mode(fresh.path) == 0o700 and _mode(fresh.path / "lock") == 0o600
    finally:
        fresh.release()
    old = tmp_path / "old"
    old.mkdir(mode=0o755)
    os.chmod(old, 0o755)
    again = StateDir(old, "compnode")
    again.acquire()
    try:
        assert _mode(old) == 0o700
    finally:
        again.release()
    temporary = StateDir(None, "compnode")
    temporary.acquire()
    try:
        assert _mode(temporary.path) == 0o700
    finally:
        temporary.release()


def test_private_files_never_exist_with_a_wider_mode(tmp_path: Path, open_umask, monkeypatch) -> None:
    # Every open() of the temporary name must already carry 0600: there is no window in which the
    # key's bytes sit in a file others can read.
    seen: list[int] = []
    real_open = os.open

    def spy(path, flags, mode=0o777, *args, **kwargs):
        if flags & os.O_CREAT:
            seen.append(mode)
        return real_open(path, flags, mode, *args, **kwargs)

    monkeypatch.setattr(os, "open", spy)
    write_private(tmp_path / "secret", b"x" * 100)
    monkeypatch.undo()
    assert seen == [0o600] and _mode(tmp_path / "secret") == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["secret"]  # no temporary left behind


def test_identity_key_is_private_and_is_the_peer_id(tmp_path: Path, open_umask) -> None:
    path = tmp_path / "p2p_identity.key"
    key = load_or_create_identity(path)
    assert _mode(path) == 0o600
    again = load_or_create_identity(path)
    assert peer_id_of(again) == peer_id_of(key)
    marker = key.get_public_key().to_bytes()
    assert owner_peer_id(marker) == peer_id_of(key)
    assert owner_peer_id(b"ssh-rsa AAAAnot-a-key") is None
    path.write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a libp2p RSA identity"):
        load_or_create_identity(path)


def test_job_files_written_by_a_daemon_process_are_0600(tmp_path: Path) -> None:
    old = os.umask(0o022)  # a typical operator's umask, which the daemon overrides
    try:
        apply_private_umask()
        files = JobFiles(tmp_path / "jobs" / "j1")
        files.save_submission({"name": "j"}, b"ir", {"w": torch.ones(2)}, {"inputs": torch.ones(2)})
        files.save_checkpoint(Checkpoint(step=1, state={"w": torch.ones(2)}), attempt=0)
    finally:
        os.umask(old)
    written = [p for p in (tmp_path / "jobs").rglob("*")]
    assert written and all(_mode(p) == (0o700 if p.is_dir() else 0o600) for p in written), {
        str(p.relative_to(tmp_path)): oct(_mode(p)) for p in written
    }


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_real_broker_keeps_its_state_dir_private(tmp_path: Path) -> None:
    """A broker process started under the usual umask 022: everything it writes is 0600 / 0700."""
    state, address = tmp_path / "broker.state", tmp_path / "broker.addr"
    cmd = [sys.executable, "-m", "fusionnet.cli.main", "--log-level", "WARNING", "broker",
           "--state-dir", str(state), "--address-file", str(address), "--refresh-period", "1"]  # fmt: skip
    old = os.umask(0o022)  # the child inherits it
    try:
        with open(tmp_path / "broker.log", "wb") as log:
            proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                cwd=Path(__file__).resolve().parents[1], start_new_session=True,
            )  # fmt: skip
    finally:
        os.umask(old)
    try:
        deadline = time.monotonic() + 90
        while not address.exists():
            assert proc.poll() is None, (tmp_path / "broker.log").read_text()
            assert time.monotonic() < deadline, "broker not ready"
            time.sleep(0.1)
        written = [p for p in state.rglob("*") if not p.is_symlink()]
        assert any(p.name == "p2p_identity.key" for p in written)
        modes = {str(p.relative_to(state)): oct(_mode(p)) for p in written}
        assert _mode(state) == 0o700, oct(_mode(state))
        assert all(_mode(p) == (0o700 if p.is_dir() else 0o600) for p in written), modes
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
