"""A daemon's Prometheus endpoint: a private registry served over HTTP on ``--metrics-port``.

Each daemon declares its own gauges on ``DaemonMetrics.registry``; a private registry (instead of the
process-global default) keeps metrics of in-process test daemons apart. To be replaced by the
``fusionnet.metrics`` package once it exists: daemons only use ``gauge()``, ``start()`` and ``stop()``.
"""

from __future__ import annotations

import logging
import threading
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, Gauge, start_http_server

from fusionnet import __version__

log = logging.getLogger("fusionnet.daemon.metrics")


class DaemonMetrics:
    def __init__(self, role: str):
        self.role = role
        self.registry = CollectorRegistry()
        self.info = self.gauge(
            "fusionnet_daemon_info", "Constant 1, labelled with the daemon", ["role", "peer_id", "version"]
        )
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def gauge(self, name: str, documentation: str, labels: list[str] | None = None) -> Gauge:
        return Gauge(name, documentation, labels or [], registry=self.registry)

    def start(self, port: int, host: str, peer_id: str) -> None:
        self.info.labels(role=self.role, peer_id=peer_id, version=__version__).set(1)
        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as e:
            raise ValueError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror})") from e
        log.info("metrics on http://%s:%d/metrics", host, self._server.server_port)

    @property
    def port(self) -> int | None:
        return None if self._server is None else self._server.server_port

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            if self._thread is not None:
                self._thread.join(timeout=5)
            self._server = self._thread = None
