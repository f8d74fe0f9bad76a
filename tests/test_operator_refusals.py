"""What an operator gets wrong when starting a daemon is one line naming the flag or file (exit 2), never
an internal error; a state file the daemon can do without (a hardware profile cache) is measured again."""

from __future__ import annotations

import argparse
import asyncio
import socket
from pathlib import Path

import pytest

from fusionnet.daemon.config import DaemonConfig
from fusionnet.daemon.flags import add_common_arguments


def test_float_flags_refuse_nan_and_inf_in_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    """``nan`` passes every check written as ``x < 0`` (a drain of ``nan`` seconds hands nothing over)."""
    p = argparse.ArgumentParser(prog="fusionnet compnode")
    add_common_arguments(p, initial_peers_required=False)
    for flag in ("--drain-timeout", "--shutdown-grace", "--refresh-period", "--rpc-max-mb"):
        for value in ("nan", "inf"):
            with pytest.raises(SystemExit) as stop:
                p.parse_args([flag, value])
            assert (
                stop.value.code == 2
                and f"argument {flag}: '{value}': a finite number" in capsys.readouterr().err
            )


def test_a_refresh_period_whose_records_would_outlive_the_dht_limit_is_refused() -> None:
    for period in (1300, 0.001, 0):
        with pytest.raises(ValueError, match=r"--refresh-period must be >= 0.1 and <= 1200 seconds"):
            DaemonConfig(refresh_period=period)
    DaemonConfig(refresh_period=1200)
    DaemonConfig(refresh_period=0.1)


def test_an_address_file_or_state_dir_of_the_wrong_kind_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"--address-file .*: is a directory"):
        DaemonConfig(address_file=tmp_path)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match=r"--state-dir .*: is not a directory"):
        DaemonConfig(state_dir=tmp_path / "file")


def test_a_damaged_broker_database_names_the_file(tmp_path: Path) -> None:
    from fusionnet.broker.store import BrokerStore

    path = tmp_path / "broker.sqlite3"
    path.write_bytes(bytes(range(256)) * 20)
    with pytest.raises(ValueError, match=r"broker.sqlite3: not a FusionNet broker database .* move it aside"):
        BrokerStore(path)


def test_a_broker_database_damaged_past_its_header_names_the_file(tmp_path: Path) -> None:
    """Disk damage to one table's page, the header and schema intact: refused at start with the file's
    name, not an "internal error" at the broker's first query."""
    import sqlite3

    from fusionnet.broker.store import BrokerStore

    path = tmp_path / "broker.sqlite3"
    store = BrokerStore(path)
    for i in range(3):
        store.create_job(f"job{i}", "mlp", steps=10)
    store.close()
    db = sqlite3.connect(path)
    db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    root = db.execute("SELECT rootpage FROM sqlite_master WHERE name = 'jobs'").fetchone()[0]
    size = db.execute("PRAGMA page_size").fetchone()[0]
    db.close()
    raw = bytearray(path.read_bytes())
    raw[(root - 1) * size : root * size] = b"Z" * size
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match=r"broker.sqlite3: not a FusionNet broker database .* move it aside"):
        BrokerStore(path)


def test_a_state_dir_the_daemon_cannot_write_is_one_line(tmp_path: Path) -> None:
    """A read-only state dir (a read-only mount, another user's folder): "cannot use it", not an
    internal error. (Root ignores permission bits, so the read-only case is made with a file where the
    lock file would go: ``os.open`` of it fails the same way.)"""
    from fusionnet.daemon.files import StateDir

    folder = tmp_path / "state"
    folder.mkdir(mode=0o700)
    (folder / "lock").mkdir()  # the lock file cannot be opened: EISDIR, as EROFS on a read-only mount
    with pytest.raises(ValueError, match=r"^--state-dir .*state: cannot use it \(Is a directory\)$"):
        StateDir(folder, "broker").acquire()


def test_an_sd_file_that_is_a_folder_is_refused(tmp_path: Path) -> None:
    from fusionnet.broker.config import BrokerConfig

    with pytest.raises(ValueError, match=r"--sd-file .*: is a directory"):
        BrokerConfig(sd_file=tmp_path)


def test_taken_http_and_data_ports_name_their_flag() -> None:
    from fusionnet.serving.http import start_api
    from fusionnet.wire.datapath import DataPathServer

    async def scenario(port: int) -> None:
        with pytest.raises(ValueError, match=rf"^--http-port {port}: cannot listen on 127.0.0.1:{port}"):
            await start_api({}, None, "127.0.0.1", port)  # type: ignore[arg-type]
        server = DataPathServer(peer_id="me")
        with pytest.raises(ValueError, match=rf"^--data-port {port}: cannot listen on 127.0.0.1:{port}"):
            await server.start("127.0.0.1", port)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        asyncio.run(scenario(taken.getsockname()[1]))


@pytest.mark.parametrize("cache", ["[]", "folder"])
def test_an_unusable_hardware_profile_cache_is_measured_again(
    tmp_path: Path, cache: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cache that is JSON of another shape, or a folder in its place, is ignored (the node profiles
    again), as an unreadable one already was; before, the compnode did not start."""
    from fusionnet.profiling import node

    measured = []

    def measure(device: str, threads: int | None, state_dir: Path) -> object:
        measured.append(device)
        return real(device, threads, state_dir)

    real = node.measure
    monkeypatch.setattr(node, "measure", measure)
    path = tmp_path / node.CACHE_FILE
    if cache == "folder":
        path.mkdir()
    else:
        path.write_text(cache)
    hw = node.profile_hardware(tmp_path)
    assert measured == ["cpu"] and hw.peak_flops > 0
