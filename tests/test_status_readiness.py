"""``status --wait-compnodes N`` counts what ``submit`` waits for: compnodes the broker lists ONLINE with a
data path outside the backup pool. It counted backups too, so a script saw "2 ready", and ``submit`` then
waited its 60 s for a second compnode and ran the job on one."""

from __future__ import annotations

import pytest

from fusionnet.cli.cmd_status import placeable
from fusionnet.runtime.jobcontrol import ready_compnodes

pytestmark = pytest.mark.timeout(10)


def _node(state: str = "ONLINE", *, backup: bool = False, known: bool = True, data: bool = True) -> dict:
    return {
        "state": state,
        "backup": backup,
        "known_to_broker": known,
        "data_path_address": "10.0.0.2:31400" if data else None,
    }


def test_backups_and_nodes_the_broker_cannot_place_on_are_not_counted() -> None:
    doc = {
        "compnodes": [
            _node(),
            _node(backup=True),
            _node(known=False),  # in the DHT, not yet in the broker's registry
            _node("JOINING"),
            _node(data=False),
            _node(backup=True, known=False),
        ]
    }
    assert placeable(doc) == 1 and placeable(doc, backups=True) == 1
    # the same count submit waits for
    assert placeable(doc) == ready_compnodes([c for c in doc["compnodes"] if c["known_to_broker"]])[0]
