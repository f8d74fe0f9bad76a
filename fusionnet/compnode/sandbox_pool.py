"""Where a compnode's sandbox workers come from (issue 12): ``SandboxPool`` owns a ``multiprocessing``
fork server that imports torch and the executor once (started in the background when the compnode
starts, so an ``assign`` does not wait 5 s for imports), and forks one worker per assignment
(``sandbox_worker``) with the daemon's settings; ``describe_exit`` names how a worker ended.
``sandbox_client.SandboxedJob`` is such a worker seen from the daemon.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import socket
from collections.abc import Callable
from typing import Any

from fusionnet.compnode.faults import FaultPoint
from fusionnet.compnode.sandbox_ipc import IPCChannel
from fusionnet.compnode.sandbox_worker import main
from fusionnet.compnode.tcp_down import DownPeers
from fusionnet.compnode.worker_process import EXIT_NO_ANSWER, WorkerConfig

PRELOAD = ["fusionnet.compnode.sandbox_preload"]  # niced, then the workers' imports


class SandboxPool:
    """Where workers come from, and what each is configured with."""

    def __init__(
        self,
        threads: int | None,
        slowdown: float,
        memory_bytes: int | None,
        fault: FaultPoint | None,
        direct_sends: bool = True,
        direct_receives: bool = True,
        inline_seconds: float = 0.0,
    ) -> None:
        self.threads = threads
        self.inline_seconds = inline_seconds
        self.direct_sends = direct_sends
        self.direct_receives = direct_receives
        self.slowdown = slowdown
        self.memory_bytes = memory_bytes
        self.fault = fault
        if fault is not None:
            fault.share()
        # Told a worker's pid when it starts and just before it stops (``metrics.workers``: its CPU).
        self.look: Callable[[int], None] | None = None
        # The daemon's peers that TCP failed to: a new worker starts with them, a worker's own failures
        # are marked there (``tcp_down``).
        self.tcp_down: DownPeers | None = None
        self.context = multiprocessing.get_context("forkserver")
        self.context.set_forkserver_preload(PRELOAD)
        self._warming: asyncio.Future[None] | None = None

    @classmethod
    def of(cls, settings: Any, fault: FaultPoint | None) -> SandboxPool:
        gb = settings.sandbox_memory_gb
        budget = None if gb is None else int(gb * 2**30)
        return cls(
            settings.threads,
            settings.slowdown,
            budget,
            fault,
            settings.worker_sends == "direct",
            settings.worker_receives == "direct",
            settings.inline_compute_ms / 1000,
        )

    def start(self) -> None:
        """Starts the fork server in the background (it imports torch: seconds), once."""
        from multiprocessing import forkserver

        if self._warming is None:
            self._warming = asyncio.ensure_future(asyncio.to_thread(forkserver.ensure_running))

    async def spawn(
        self, peer_id: str, job_id: str, subdag: int
    ) -> tuple[Any, IPCChannel, socket.socket | None]:
        """A worker: its process, its call channel, and where its peer connections are passed to it
        (None: it reads none, its daemon relays its values)."""
        self.start()
        assert self._warming is not None
        await self._warming
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        handoff: tuple[socket.socket, socket.socket] | None = None
        if self.direct_receives:
            handoff = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        config = WorkerConfig(
            peer_id=peer_id,
            job_id=job_id,
            subdag=subdag,
            threads=self.threads,
            slowdown=self.slowdown,
            memory_bytes=self.memory_bytes,
            daemon_pid=os.getpid(),
            fault=None if self.fault is None else self.fault.for_worker(),
            log_level=logging.getLogger().getEffectiveLevel(),
            direct_sends=self.direct_sends,
            direct_receives=handoff is not None,
            inline_seconds=self.inline_seconds,
            tcp_down=() if self.tcp_down is None else tuple(self.tcp_down.entries()),
        )
        args = (theirs, config) if handoff is None else (theirs, config, handoff[1])
        process = self.context.Process(target=main, args=args, name=f"fusionnet-job-{job_id}", daemon=True)
        await asyncio.to_thread(process.start)
        if self.look is not None and process.pid is not None:
            self.look(process.pid)
        theirs.close()
        if handoff is None:
            return process, IPCChannel(ours), None
        handoff[1].close()
        # Non-blocking: a worker that stops taking connections gets them refused, never the daemon stalled.
        handoff[0].setblocking(False)
        return process, IPCChannel(ours), handoff[0]


def describe_exit(code: int | None) -> str:
    if code is None:
        return "it stopped answering"
    if code < 0:
        try:
            return f"it was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"it was killed by signal {-code}"
    if code == EXIT_NO_ANSWER:
        return "it could not send an answer: out of memory"
    return f"it exited with status {code}"
