"""The lifecycle every FusionNet daemon shares: ``serve()`` = startup -> main loop -> graceful shutdown.

Modelled on uvicorn's server: SIGINT/SIGTERM only set ``should_exit``; a second signal sets ``force_exit``,
which cuts every remaining graceful step short (and a watchdog thread ends the process if even that
hangs). Every background task is owned (``spawn``) and cancelled on shutdown; readiness is the address file,
written only once the daemon is fully up. Shutdown always stops the DHT child (and with it p2pd), whether
startup finished or not.

Subclasses fill three hooks: ``on_startup`` (announce, start loops and services), ``on_draining`` (first
step of a graceful exit) and ``on_stopped`` (the last word, e.g. an OFFLINE record).

Metrics: ``self.metrics`` is the daemon's ``fusionnet.metrics`` set (``BrokerMetrics`` / ``CompnodeMetrics``),
served on ``--metrics-port`` from just after the peer starts until shutdown (``metrics_endpoint`` says where);
the broker adds Prometheus service discovery to that server (``metrics_sd_source``).

Extension points for code outside the daemon (job intake on the broker, sub-task execution on a compnode):
``add_service(service)`` before ``serve()``; a service's ``rpc_<name>`` coroutines are served next to the
daemon's own; it gets ``start()`` during startup and ``stop()`` during the graceful shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ClassVar, NoReturn, Protocol, runtime_checkable

from fusionnet.daemon.addresses import useful_maddrs
from fusionnet.daemon.config import DaemonConfig
from fusionnet.daemon.files import StateDir, apply_private_umask, write_address_file
from fusionnet.daemon.logs import install_peer_label
from fusionnet.daemon.memory import return_large_buffers
from fusionnet.daemon.swarm import SwarmPeer
from fusionnet.metrics.common import BaseMetrics
from fusionnet.metrics.sd import TargetSource
from fusionnet.metrics.server import MetricsEndpoint, start_metrics_server, stop_metrics_server

log = logging.getLogger("fusionnet.daemon")

FORCED_EXIT_CODE = 130
_FORCE_WATCHDOG_S = 10.0  # after a forced exit request, the process ends within this long, whatever happens


@runtime_checkable
class Service(Protocol):
    """A pluggable part of a daemon. ``stop()`` is the graceful leave: finish or hand over work."""

    name: str

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Daemon:
    role: ClassVar[str] = "daemon"

    def __init__(self, config: DaemonConfig, metrics: BaseMetrics | None = None):
        self.config = config
        self.state_dir = StateDir(config.state_dir, self.role)
        # A fresh set per daemon unless given one: in-process test daemons keep their numbers apart.
        self.metrics = metrics if metrics is not None else BaseMetrics(self.role, process=False)
        self.metrics_endpoint: MetricsEndpoint | None = None
        self.services: list[Service] = []
        self.peer: SwarmPeer | None = None
        self.should_exit = asyncio.Event()
        self.force_exit = asyncio.Event()
        self.ready = asyncio.Event()
        self.started_at = 0.0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._started_services: list[Service] = []
        self._fatal: BaseException | None = None
        self._state_locked = False

    # ---- extension points ------------------------------------------------------------------------
    def add_service(self, service: Service) -> None:
        if self.peer is not None:
            raise RuntimeError("add_service() must be called before serve()")
        if not isinstance(service, Service):
            raise TypeError(f"{service!r} lacks name/start()/stop() of a daemon Service")
        self.services.append(service)

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Runs ``coro`` as a task the daemon owns: cancelled on shutdown; if it fails, the daemon stops
        (a dead background loop must not leave a zombie daemon that looks healthy)."""
        task = asyncio.create_task(coro, name=f"{self.role}:{name}")
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def every(self, period: float, step: Callable[[], Awaitable[None]], name: str) -> asyncio.Task[Any]:
        """Owned loop calling ``step`` every ``period`` s; a failing step is logged and retried later."""

        async def loop() -> None:
            # Runs until cancelled, not until should_exit: a DRAINING compnode must keep its record alive.
            while True:
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception as e:
                    log.warning("%s failed: %s: %s", name, type(e).__name__, e)
                await asyncio.sleep(period)

        return self.spawn(loop(), name)

    @property
    def peer_id(self) -> str:
        assert self.peer is not None, "peer id is known once startup has joined the DHT"
        return self.peer.peer_id

    async def call(self, peer: str, method: str, payload: dict[str, Any] | None = None, **kw: Any) -> dict:
        assert self.peer is not None
        return await self.peer.client.call(peer, method, payload, **kw)

    # ---- hooks -----------------------------------------------------------------------------------
    async def on_startup(self) -> None:
        """The peer is up and serving RPC; announce, start loops, ``await self.start_services()``."""

    async def on_draining(self) -> None:
        """First step of a graceful shutdown (services are still running)."""

    async def on_stopped(self) -> None:
        """Services are stopped and background tasks cancelled; RPC still serves, the DHT still runs."""

    def metrics_sd_source(self) -> TargetSource | None:
        """Scrape targets to serve as Prometheus http_sd next to ``/metrics`` (the broker's compnodes).
        Called from the metrics server's thread: return a snapshot, never walk live daemon state."""
        return None

    async def start_services(self) -> None:
        for service in self.services:
            await service.start()
            self._started_services.append(service)
            log.info("service %s started", service.name)

    # ---- lifecycle -------------------------------------------------------------------------------
    def serve(self) -> int:
        apply_private_umask()  # this process is the daemon: everything it writes is private
        return_large_buffers()  # freed message buffers leave the process (``daemon.memory``)
        return asyncio.run(self.serve_async())

    def serve_and_exit(self) -> NoReturn:
        """``serve()``, then the process ends with its exit code without the interpreter's teardown.

        By then the shutdown has stopped everything the daemon started (services, sandbox workers, the
        DHT child and p2pd, the metrics server) and released the state dir. What is left is finalising
        the modules of torch, transformers and hivemind: seconds of garbage collection (2.5-3 s per
        daemon measured here, ``gc_collect_main``) between "stopped" and the exit, which every restart,
        ``systemctl stop`` and test paid."""
        code = self.serve()
        logging.shutdown()  # flushes every handler: the last lines of the log are written
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    async def serve_async(self, *, install_signals: bool = True) -> int:
        if install_signals:
            self._install_signal_handlers()
        try:
            startup = asyncio.create_task(self._startup(), name=f"{self.role}:startup")
            interrupted = asyncio.create_task(self.should_exit.wait())
            await asyncio.wait({startup, interrupted}, return_when=asyncio.FIRST_COMPLETED)
            interrupted.cancel()
            if not startup.done():
                log.info("stop requested during startup")
                startup.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await startup
            else:
                startup.result()  # a failed startup raises here, after which we still clean up
                self.ready.set()
                await self.should_exit.wait()  # the main loop: background tasks do the work
        finally:
            await self._shutdown()
            if install_signals:
                self._remove_signal_handlers()
        if self.force_exit.is_set():
            return FORCED_EXIT_CODE
        if self._fatal is not None:
            log.error("stopped because a background task failed: %r", self._fatal)
            return 1
        return 0

    async def _startup(self) -> None:
        self.state_dir.acquire()
        self._state_locked = True
        self.started_at = time.time()
        self.peer = await SwarmPeer.start(
            self.config.dht, serve=True, max_message_bytes=self.config.rpc_max_bytes
        )
        install_peer_label(self.role, self.peer_id)
        assert self.peer.server is not None
        self.peer.server.add_handlers(self)
        for service in self.services:
            self.peer.server.add_handlers(service)
        await self.peer.server.start()
        self.metrics.set_peer(self.peer_id, started_at=self.started_at)
        if self.config.metrics_port is not None:
            self.metrics_endpoint = start_metrics_server(
                self.metrics.registry,
                self.config.metrics_port,
                self.config.metrics_host,
                sd_source=self.metrics_sd_source(),
            )
        await self.on_startup()
        self.metrics.up_since.set(time.time())
        maddrs = useful_maddrs(await self.peer.visible_maddrs())
        if self.config.address_file is not None:
            write_address_file(self.config.address_file, maddrs)
        log.info("%s ready: peer id %s, listening on %s", self.role, self.peer_id, " ".join(maddrs))

    async def _graceful(self, step: Awaitable[Any], what: str, timeout: float | None = None) -> None:
        """Runs one graceful shutdown step unless a forced exit cuts it short (or it exceeds ``timeout``)."""
        task = asyncio.ensure_future(step)
        forced = asyncio.create_task(self.force_exit.wait())
        try:
            await asyncio.wait({task, forced}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        finally:
            forced.cancel()
        if not task.done():
            log.warning("%s: %s", what, "skipped (forced exit)" if self.force_exit.is_set() else "timed out")
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        elif not task.cancelled() and task.exception() is not None:
            log.warning("%s failed: %r", what, task.exception())

    async def _shutdown(self) -> None:
        self.should_exit.set()
        if self.config.address_file is not None:
            try:
                self.config.address_file.unlink(missing_ok=True)
            except OSError as e:  # the shutdown goes on: the departure, the services, the DHT, the lock
                log.warning("cannot remove --address-file %s: %s", self.config.address_file, e)
        if self.peer is not None:
            log.info("shutting down")
            await self._graceful(self.on_draining(), "announcing departure")
            for service in reversed(self._started_services):
                await self._graceful(
                    service.stop(), f"stopping service {service.name}", timeout=self.config.drain_timeout
                )
            await self._cancel_tasks()
            await self._graceful(self.on_stopped(), "final announcement")
            if self.force_exit.is_set():
                await self.peer.kill()
            else:
                await self._graceful(
                    self.peer.stop(rpc_grace=self.config.shutdown_grace), "leaving the swarm"
                )
                if self.force_exit.is_set():
                    await self.peer.kill()
        await self._cancel_tasks()
        if self.metrics_endpoint is not None:
            stop_metrics_server(self.metrics_endpoint)
            self.metrics_endpoint = None
        if self._state_locked:
            self.state_dir.release()
        log.info("%s stopped", self.role)

    async def _cancel_tasks(self) -> None:
        tasks = [t for t in self._tasks if not t.done()]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=5.0)

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or task.exception() is None:
            return
        if self._fatal is None:
            self._fatal = task.exception()
            log.error("background task %s failed", task.get_name(), exc_info=task.exception())
        self.should_exit.set()

    # ---- signals ---------------------------------------------------------------------------------
    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)

    def _remove_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)

    def _on_signal(self, sig: signal.Signals) -> None:
        if not self.should_exit.is_set():
            log.info("received %s: shutting down gracefully (send it again to force)", sig.name)
            self.should_exit.set()
            return
        if not self.force_exit.is_set():
            log.warning("received %s again: forcing exit", sig.name)
            self.force_exit.set()
            threading.Thread(target=self._watchdog, name="fusionnet-force-exit", daemon=True).start()

    def _watchdog(self) -> None:
        """Ends the process if the forced shutdown itself hangs (e.g. the loop is blocked in native code)."""
        time.sleep(_FORCE_WATCHDOG_S)
        log.error("forced shutdown did not finish in %.0f s: exiting now; where it hung:", _FORCE_WATCHDOG_S)
        faulthandler.dump_traceback(all_threads=True)
        if self.peer is not None and self.peer.dht.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.peer.dht.pid, signal.SIGKILL)
        os._exit(FORCED_EXIT_CODE)
