"""Starting and stopping this process's hivemind DHT node (a forked child process that runs p2pd).

hivemind runs the DHT in a child process (``hivemind.DHT`` is a ``ForkProcess``), which in turn runs the
libp2p daemon ``p2pd``. Two things are added here so that no process is ever left behind:

- the child moves into its own process group, so a Ctrl-C at a terminal reaches only the daemon, which
  then announces its departure and stops the DHT in order (p2pd dies on SIGINT; if it got the terminal's
  Ctrl-C directly, the daemon could no longer say goodbye);
- the child watches its parent: if the daemon dies without stopping it (SIGKILL, crash), the child shuts
  its DHT node down (which stops p2pd) and exits.

Call ``start_dht`` before anything starts threads in torch: forking a process that runs OpenMP threads is
unsafe.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.p2p import P2P, PeerID
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr

from fusionnet.dht.identity import load_or_create_identity
from fusionnet.dht.peerids import peer_ids_of_maddrs
from fusionnet.errors import JobError, WireError

log = logging.getLogger("fusionnet.dht.node")

DEFAULT_HOST_MADDRS = ("/ip4/127.0.0.1/tcp/0",)
_PARENT_POLL_S = 0.5
_ORPHAN_GRACE_S = 10.0
# How long a start waits for a taken listen port to come free before refusing it: a daemon restarted
# right after a SIGKILL finds its port held by the dead one's p2pd until that p2pd's parent-watch notices
# (``_PARENT_POLL_S``) and shuts it down (at most ``_ORPHAN_GRACE_S``).
PORT_WAIT_S = _PARENT_POLL_S + _ORPHAN_GRACE_S + 1.5
_PORT_POLL_S = 0.25


@dataclass
class DHTConfig:
    """How this peer joins the swarm. Multiaddrs are validated here so a typo fails before anything starts."""

    initial_peers: Sequence[str] = ()
    host_maddrs: Sequence[str] = DEFAULT_HOST_MADDRS
    announce_maddrs: Sequence[str] = ()
    # libp2p RSA identity: a stable peer id across restarts, and the key that signs our DHT records
    identity_path: Path | None = None
    client_mode: bool = False  # a client (e.g. `fusionnet status`) stores nothing for others
    startup_timeout: float = 60.0
    extra: dict[str, object] = field(default_factory=dict)  # passed to hivemind.DHT (tests, tuning)

    def __post_init__(self) -> None:
        for flag, addrs in (
            ("--initial-peers", self.initial_peers),
            ("--host-maddrs", self.host_maddrs),
            ("--announce-maddrs", self.announce_maddrs),
        ):
            for addr in addrs:
                try:
                    Multiaddr(addr)
                except Exception as e:  # multiaddr raises several types (ValueError, StringParseError, ...)
                    raise ValueError(f"{flag}: {addr!r} is not a multiaddr ({e})") from e
        if not self.host_maddrs:
            raise ValueError("--host-maddrs: at least one listen address is needed")
        if self.startup_timeout <= 0:
            raise ValueError(f"DHT startup timeout must be > 0, got {self.startup_timeout}")


def check_initial_peers(initial_peers: Sequence[str]) -> None:
    """``JobError`` (bad input: one line, exit 2) for an ``--initial-peers`` value that is not a multiaddr
    or names no peer id, before a command (a client or a daemon) traces, uploads or dials anything. Without
    ``/p2p/PEERID`` libp2p cannot dial it (its daemon fails seconds later with a Go log line), and a client
    could not pin its broker."""
    try:
        DHTConfig(initial_peers=list(initial_peers))  # validates them, starts nothing
    except ValueError as e:
        raise JobError(str(e)) from None
    for addr in initial_peers:
        if not peer_ids_of_maddrs([addr]):
            raise JobError(
                f"--initial-peers: {addr[:200]!r} names no peer id: give the whole address, "
                "/ip4/HOST/tcp/PORT/p2p/PEERID (a line of the peer's --address-file)"
            )


class SwarmDHT(hivemind.DHT):
    """``hivemind.DHT`` whose child process leaves the terminal's process group and dies with its parent."""

    def run(self) -> None:  # runs in the child process
        # A forked child inherits the parent's signal set-up; with asyncio's handlers, SIGTERM would only poke
        # the parent's event loop (through the inherited wakeup fd) and never stop this process.
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the daemon's business; it stops us in order
        with contextlib.suppress(OSError):
            os.setpgid(0, 0)
        threading.Thread(target=self._watch_parent, name="fusionnet-parent-watch", daemon=True).start()
        super().run()

    def _watch_parent(self) -> None:
        while os.getppid() == self._parent_pid:
            time.sleep(_PARENT_POLL_S)
        # Orphaned: remove the files the dead parent cannot, ask our own event loop (through the same pipe the
        # parent uses) to shut the node down, which terminates p2pd; if that does not finish, leave anyway.
        for path in getattr(self, "_orphan_files", ()):
            with contextlib.suppress(OSError):
                os.unlink(path)
        with contextlib.suppress(Exception):
            self._outer_pipe.send(("_shutdown", [], {}))
        time.sleep(_ORPHAN_GRACE_S)
        os._exit(1)


async def _remember_orphan_files(dht: SwarmDHT, _node: object, paths: tuple[str, ...]) -> None:
    dht._orphan_files = paths  # runs in the child: its parent-watch removes these if the parent dies


async def remove_with_parent(dht: SwarmDHT, p2p: P2P) -> None:
    """Tells the DHT child to remove this process's p2pd client socket should we die without cleaning up
    (SIGKILL): the replica's socket lives in /tmp and nobody else would ever delete it."""
    maddr = getattr(p2p, "_client_listen_maddr", None)  # hivemind keeps the path private
    path = str(maddr or "")
    if path.startswith("/unix/"):
        await dht.run_coroutine(
            partial(_remember_orphan_files, paths=(path[len("/unix") :],)), return_future=True
        )


def _identity(config: DHTConfig) -> tuple[RSAPrivateKey, Path, Path | None]:
    """Our RSA identity, the file p2pd reads it from, and a scratch folder to remove once the DHT is up
    (when there is no state dir to keep the identity in). One key is both the peer id and the signer
    of our DHT records, which is what lets everyone check that a record is really ours."""
    if config.identity_path is not None:
        return load_or_create_identity(config.identity_path), config.identity_path, None
    scratch = Path(tempfile.mkdtemp(prefix="fusionnet-identity-"))  # 0700 from creation
    path = scratch / "p2p_identity.key"
    return load_or_create_identity(path), path, scratch


def _start_blocking(config: DHTConfig, validator: RSASignatureValidator, identity: Path) -> SwarmDHT:
    kwargs: dict[str, object] = dict(
        host_maddrs=list(config.host_maddrs),
        client_mode=config.client_mode,
        record_validators=[validator],
        **config.extra,
    )
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    kwargs["identity_path"] = str(identity)
    # The state dir is locked by its daemon (or the identity is brand new), so the identity cannot be in
    # use by a sibling; skipping the check saves starting a second p2pd.
    kwargs["check_if_identity_free"] = False
    return SwarmDHT(initial_peers=list(config.initial_peers) or None, start=False, **kwargs)


def check_ports_free(host_maddrs: Sequence[str]) -> None:
    """``ValueError`` naming the flag when a TCP port of ``--host-maddrs`` (other than 0) is in use. Why
    here: p2pd binds with SO_REUSEPORT, so a second daemon on a taken port starts as if all were well,
    and the kernel then splits the swarm's connections between the two. A plain bind (SO_REUSEADDR
    only: a port left in TIME_WAIT by a daemon that just stopped is fine) fails on a port someone
    listens on."""
    for m in host_maddrs:
        ma = Multiaddr(m)
        names = [p.name for p in ma.protocols()]
        if "tcp" not in names or int(ma.value_for_protocol("tcp")) == 0:
            continue
        if "ip4" in names:
            family, host = socket.AF_INET, ma.value_for_protocol("ip4")
        elif "ip6" in names:
            family, host = socket.AF_INET6, ma.value_for_protocol("ip6")
        else:
            continue  # a DNS name: p2pd resolves it
        port = int(ma.value_for_protocol("tcp"))
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, port))
            except OSError as e:
                raise ValueError(
                    f"--host-maddrs {m}: cannot listen on port {port} ({e.strerror or e})"
                ) from None


# Where hivemind has p2pd listen for its clients (``P2P._UNIX_SOCKET_PREFIX``). A p2pd that fails to start
# exits without removing its socket, which hivemind only unlinks while p2pd lives.
P2PD_SOCKETS = Path("/tmp/hivemind-p2pd-*.sock")


async def wait_for_free_ports(host_maddrs: Sequence[str], wait: float = PORT_WAIT_S) -> None:
    """``check_ports_free``, retried for up to ``wait`` seconds (logged once) before its refusal stands."""
    deadline = time.monotonic() + wait
    logged = False
    while True:
        try:
            check_ports_free(host_maddrs)
            return
        except ValueError as e:
            if time.monotonic() >= deadline:
                raise
            if not logged:
                log.warning("%s; waiting up to %.0f s for it to be freed (a stopped daemon's p2pd?)", e, wait)
                logged = True
        await asyncio.sleep(_PORT_POLL_S)


def _remove_dead_sockets(paths: set[Path]) -> None:
    """Removes those of ``paths`` that nobody listens on (a failed start's), leaving any live one."""
    for path in paths:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
            try:
                probe.connect(str(path))
            except (ConnectionRefusedError, FileNotFoundError):
                path.unlink(missing_ok=True)
            except OSError:
                pass  # not ours to judge


async def start_dht(config: DHTConfig) -> tuple[SwarmDHT, RSASignatureValidator]:
    """Forks the DHT child and waits (without blocking the event loop) until it has joined the swarm."""
    await wait_for_free_ports(config.host_maddrs)
    key, identity, scratch = _identity(config)
    validator = RSASignatureValidator(key)
    dht = _start_blocking(config, validator, identity)
    sockets_before = set(P2PD_SOCKETS.parent.glob(P2PD_SOCKETS.name))
    dht.start()  # the fork happens here, on the event loop's thread
    try:
        await asyncio.to_thread(dht.wait_until_ready, config.startup_timeout)
    except BaseException as e:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
        await stop_dht(dht, timeout=3.0)
        _remove_dead_sockets(set(P2PD_SOCKETS.parent.glob(P2PD_SOCKETS.name)) - sockets_before)
        if isinstance(e, Exception) and not isinstance(e, asyncio.CancelledError):
            peers = ", ".join(config.initial_peers) or "none (new swarm)"
            raise WireError(f"could not start or join the DHT (initial peers: {peers}): {e}") from e
        raise
    if scratch is not None:
        shutil.rmtree(scratch, ignore_errors=True)  # p2pd has read it; the key lives on in memory only
    return dht, validator


async def _join_through(_dht: SwarmDHT, node: Any, maddrs: tuple[str, ...], timeout: float) -> int:
    """Runs in the DHT child: dials each peer (its multiaddrs grouped by ``/p2p/`` id) and pings it into
    the routing table, all at once, each within ``timeout``; returns how many answered."""
    by_peer: dict[str, list[Multiaddr]] = {}
    for m in maddrs:
        ma = Multiaddr(m)
        peer = ma.value_for_protocol("p2p")
        by_peer.setdefault(peer, []).append(ma.decapsulate(Multiaddr(f"/p2p/{peer}")))

    async def one(peer: str, addrs: list[Multiaddr]) -> bool:
        peer_id = PeerID.from_base58(peer)
        try:
            await asyncio.wait_for(node.p2p._client.connect(peer_id, addrs), timeout)
            return await asyncio.wait_for(node.protocol.call_ping(peer_id), timeout) is not None
        except Exception:  # gone, refused, not a DHT peer: the others may still answer
            return False

    return sum(await asyncio.gather(*(one(p, a) for p, a in by_peer.items())))


async def join_through(dht: SwarmDHT, maddrs: Sequence[str], timeout: float = 5.0) -> int:
    """Adds the DHT peers at ``maddrs`` (each with its ``/p2p/`` id) to a running DHT node; how many
    answered. Unlike ``--initial-peers`` at start-up (p2pd refuses to start when none of those answers),
    peers that are gone cost only ``timeout``."""
    valid = []
    for m in maddrs:
        try:
            if Multiaddr(m).value_for_protocol("p2p"):
                valid.append(m)
        except Exception:
            log.warning("not a multiaddr with a /p2p/ peer id, skipped: %r", m[:200])
    if not valid:
        return 0
    return int(
        await dht.run_coroutine(
            partial(_join_through, maddrs=tuple(valid), timeout=timeout), return_future=True
        )
    )


async def stop_dht(dht: hivemind.DHT, timeout: float = 5.0) -> None:
    """Shuts the DHT child down (which stops p2pd); terminates it if it does not exit in time."""
    if dht.pid is None:
        return
    dht.shutdown_timeout = timeout
    await asyncio.to_thread(dht.shutdown)
    if dht.is_alive():
        dht.kill()
        await asyncio.to_thread(dht.join, 2.0)


def kill_dht(dht: hivemind.DHT) -> None:
    """Forced exit: SIGTERM the DHT child now (p2pd exits when its parent dies)."""
    if dht.pid is not None and dht.is_alive():
        with contextlib.suppress(ProcessLookupError):
            dht.terminate()
