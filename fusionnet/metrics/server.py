"""A daemon's metrics HTTP endpoint: ``/metrics`` for its registry, ``/sd/compnodes`` on the broker.

One small threaded WSGI server per daemon, on a daemon thread, started once the daemon is ready
and stopped in its shutdown path (never by ``__del__``). Port 0 binds a free port; the returned
``MetricsEndpoint`` says which, and is the handle ``stop_metrics_server`` takes.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable
from socketserver import ThreadingMixIn
from typing import Any, NamedTuple
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from fusionnet.metrics.sd import SD_PATH, TargetSource, http_sd_app

log = logging.getLogger("fusionnet.metrics.server")


class MetricsEndpoint(NamedTuple):
    """Where a metrics server listens (unpacks as ``host, port``)."""

    host: str
    port: int


# A scrape is one short request: a client that sends nothing for this long is dropped, and at most this many
# are answered at once (one thread each); more are closed at once. The port may face a network (the
# systemd units bind 0.0.0.0): half-sent requests must not pile up threads in the daemon.
REQUEST_TIMEOUT = 10.0
MAX_CONCURRENT = 16


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a slow scraper must not hold up shutdown
    allow_reuse_address = True

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._slots = threading.BoundedSemaphore(MAX_CONCURRENT)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            log.debug("metrics endpoint busy: closing a connection from %s", client_address)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        # a client that timed out or went away: not worth socketserver's traceback on stderr
        log.debug("metrics request from %s failed", client_address, exc_info=True)


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Scrapes every second would flood stderr with access lines; log them at debug level instead."""

    timeout = REQUEST_TIMEOUT  # on the connection's socket: a silent client times out

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)


_SERVERS: dict[MetricsEndpoint, tuple[WSGIServer, threading.Thread]] = {}
_LOCK = threading.Lock()


def metrics_app(registry: CollectorRegistry, sd_source: TargetSource | None = None) -> Callable[..., Any]:
    """The WSGI app: ``/metrics`` (and ``/``) expose ``registry``; ``SD_PATH`` serves http_sd if given."""
    prometheus = make_wsgi_app(registry)
    sd = http_sd_app(sd_source) if sd_source is not None else None

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "/")
        if path in ("/", "/metrics"):
            return prometheus(environ, start_response)
        if sd is not None and path == SD_PATH:
            return sd(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics\n"]

    return app


def start_metrics_server(
    registry: CollectorRegistry,
    port: int,
    host: str = "0.0.0.0",
    *,
    sd_source: TargetSource | None = None,
) -> MetricsEndpoint:
    """Serve ``registry`` on ``host:port`` (port 0 = a free port) in a background thread.

    ``sd_source`` (broker only) returns the compnodes as (host, metrics_port, role, backup, peer_id);
    it is then served as Prometheus http_sd at ``/sd/compnodes``. A port in use is a user error.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port < 65536:
        raise ValueError(f"--metrics-port must be in 0..65535, got {port!r}")
    server_class = _Server6 if ":" in host else _Server
    try:
        server = make_server(
            host,
            port,
            metrics_app(registry, sd_source),
            server_class=server_class,
            handler_class=_QuietHandler,
        )
    except OSError as e:
        raise ValueError(f"--metrics-port {port}: cannot listen on {host}:{port} ({e.strerror or e})") from e
    bound = MetricsEndpoint(host, server.server_address[1])
    thread = threading.Thread(target=server.serve_forever, name=f"metrics:{bound.port}", daemon=True)
    thread.start()
    with _LOCK:
        _SERVERS[bound] = (server, thread)
    log.info("metrics on http://%s:%d/metrics", host, bound.port)
    return bound


def stop_metrics_server(endpoint: tuple[str, int]) -> None:
    """Stop a server started by ``start_metrics_server``; stopping one that is not running is a no-op."""
    with _LOCK:
        entry = _SERVERS.pop(MetricsEndpoint(*endpoint), None)
    if entry is None:
        return
    server, thread = entry
    server.shutdown()
    server.server_close()
    thread.join(timeout=5)
