"""Finding the services other packages plug into a daemon, by a fixed module convention.

``fusionnet.broker.jobs`` (job intake/orchestration) and ``fusionnet.compnode.tasks`` (sub-task execution)
each expose ``make_service(daemon) -> Service | list[Service]``. A module that does not exist (yet) is
simply skipped; any other import error is a bug and propagates.
"""

from __future__ import annotations

import importlib
import logging

from fusionnet.daemon.base import Daemon, Service

log = logging.getLogger("fusionnet.daemon.plugins")

BROKER_PLUGIN = "fusionnet.broker.jobs"
COMPNODE_PLUGIN = "fusionnet.compnode.tasks"


def add_plugin_services(daemon: Daemon, module_name: str) -> list[Service]:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name == module_name:
            log.debug("no %s module: %s runs without it", module_name, daemon.role)
            return []
        raise
    factory = getattr(module, "make_service", None)
    if factory is None:
        raise TypeError(f"{module_name} must define make_service({daemon.role}) -> Service | list[Service]")
    made = factory(daemon)
    services = list(made) if isinstance(made, list | tuple) else [made]
    for service in services:
        daemon.add_service(service)
    return services
