"""Settings every daemon shares, filled from the command-line flags of ``flags.py``.

One dataclass validated in ``__post_init__`` (a bad value fails before anything starts, with the flag's
name); the broker and compnode add their own settings in their own config classes.
"""

from __future__ import annotations

import argparse
import contextlib
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from fusionnet.daemon.flags import DEFAULT_REFRESH_PERIOD
from fusionnet.dht.announce import DEFAULT_MAX_TTL
from fusionnet.dht.node import DHTConfig
from fusionnet.rpc.protocol import DEFAULT_MAX_MESSAGE_BYTES

MAX_REFRESH_PERIOD = DEFAULT_MAX_TTL / 3  # others refuse a record meant to live longer
MIN_REFRESH_PERIOD = 0.1  # faster re-announcements (a DHT store and lookup each) only burn the cores


@dataclass
class DaemonConfig:
    dht: DHTConfig = field(default_factory=DHTConfig)
    state_dir: Path | None = None
    address_file: Path | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    refresh_period: float = DEFAULT_REFRESH_PERIOD  # seconds between re-announcements of our DHT record
    record_ttl: float | None = None  # how long a record lives without refresh; default 3 refresh periods
    rpc_max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    shutdown_grace: float = 10.0  # seconds in-flight RPC calls may take to finish on shutdown
    drain_timeout: float = 60.0  # seconds each service may take to finish or hand over its work on shutdown

    def __post_init__(self) -> None:
        if not MIN_REFRESH_PERIOD <= self.refresh_period <= MAX_REFRESH_PERIOD:
            raise ValueError(
                f"--refresh-period must be >= {MIN_REFRESH_PERIOD:g} and <= {MAX_REFRESH_PERIOD:g} seconds "
                f"(a record lives 3 periods, at most {DEFAULT_MAX_TTL:g} s), got {self.refresh_period}"
            )
        if self.record_ttl is None:
            self.record_ttl = 3 * self.refresh_period
        if self.record_ttl <= self.refresh_period:
            raise ValueError(
                f"record ttl ({self.record_ttl} s) must exceed the refresh period ({self.refresh_period} s), "
                "or records expire between refreshes"
            )
        if self.address_file is not None and self.address_file.is_dir():
            raise ValueError(f"--address-file {self.address_file}: is a directory; give the file's path")
        if self.address_file is not None:
            check_address_folder(self.address_file)
        if self.state_dir is not None and self.state_dir.exists() and not self.state_dir.is_dir():
            raise ValueError(f"--state-dir {self.state_dir}: is not a directory")
        if self.metrics_port is not None and not 0 <= self.metrics_port < 65536:
            raise ValueError(f"--metrics-port must be in 0..65535, got {self.metrics_port}")
        if self.rpc_max_bytes < 1024:
            raise ValueError(
                f"--rpc-max-mb must be at least 1 KiB (0.001), got {self.rpc_max_bytes / 2**20:g}"
            )
        if self.shutdown_grace < 0:
            raise ValueError(f"--shutdown-grace must be >= 0, got {self.shutdown_grace}")
        if self.drain_timeout < 0:
            raise ValueError(f"--drain-timeout must be >= 0, got {self.drain_timeout}")


def check_address_folder(path: Path) -> None:
    """The address file is written once the daemon is up (``files.write_address_file``): a folder it
    cannot be written in is refused now, in one line, not found out after the daemon started. Folders
    made for the check are removed again (the daemon makes them when it writes the file)."""
    made: list[Path] = []  # deepest first
    folder = path.parent
    while not folder.exists() and folder != folder.parent:
        made.append(folder)
        folder = folder.parent
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(prefix=f".{path.name}.", dir=path.parent):  # as the daemon will
            pass
    except OSError as e:
        why = e.strerror or str(e)
        raise ValueError(f"--address-file {path}: cannot write a file in {path.parent} ({why})") from None
    finally:
        for folder in made:
            with contextlib.suppress(OSError):
                folder.rmdir()


def common_config(args: argparse.Namespace, role: str) -> DaemonConfig:
    state_dir = args.state_dir
    dht = DHTConfig(
        initial_peers=tuple(args.initial_peers),
        host_maddrs=tuple(args.host_maddrs),
        announce_maddrs=tuple(args.announce_maddrs),
        identity_path=None if state_dir is None else state_dir / "p2p_identity.key",
    )
    return DaemonConfig(
        dht=dht,
        state_dir=state_dir,
        address_file=args.address_file,
        metrics_port=args.metrics_port,
        metrics_host=args.metrics_host,
        refresh_period=args.refresh_period,
        rpc_max_bytes=int(args.rpc_max_mb * 2**20),
        shutdown_grace=args.shutdown_grace,
        drain_timeout=args.drain_timeout,
    )
