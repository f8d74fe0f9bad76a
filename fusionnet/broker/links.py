"""Probing the links of a placement: the broker's glue between the compnodes and ``planning.links``.

After a placement is assigned, every compnode that sends activations is asked to time its links to the
receivers (``compnode.linkprobe``: round trips over the job's own data path); the answers go into the
broker's ``LinkBook``, which the planner reads.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from fusionnet.perfmodel.types import Link
from fusionnet.planning.links import LinkBook

log = logging.getLogger("fusionnet.broker.links")

PROBE_TIMEOUT = 20.0  # seconds for one compnode's probes (a few dozen round trips)


def parse_probe_reply(reply: object) -> dict[int, Link]:
    """``probe_links``'s answer as sub-DAG index -> ``Link``; entries that are not two finite,
    non-negative numbers are left out (a confused or hostile compnode cannot poison the planner)."""
    return {i: link for i, (link, _) in parse_probed_links(reply).items()}


def parse_probed_links(reply: object) -> dict[int, tuple[Link, bool]]:
    """``parse_probe_reply``, with whether each link is a bound (too slow for its probes to fit)."""
    out: dict[int, tuple[Link, bool]] = {}
    links = reply.get("links") if isinstance(reply, dict) else None
    if not isinstance(links, dict):
        return out
    for key, doc in links.items():
        if not isinstance(key, str) or not key.isdigit() or not isinstance(doc, dict):
            continue
        alpha, beta = doc.get("alpha"), doc.get("beta")
        if all(
            isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v) and 0 <= v < 60
            for v in (alpha, beta)
        ):
            link = Link(alpha=float(alpha), beta=float(beta))  # type: ignore[arg-type]
            out[int(key)] = (link, doc.get("bound") is True)
    return out


Call = Callable[[str, str, dict[str, Any], float], Awaitable[dict[str, Any]]]


async def probe_placement(
    job_id: str,
    peers: Sequence[str],
    consumers: Mapping[int, set[int]],
    book: LinkBook,
    call: Call,
    *,
    fresh: bool = False,
) -> bool:
    """Asks every sub-DAG's compnode (``peers[i]``) to time its links to the sub-DAGs it sends to
    (``consumers[i]``) that ``book`` has no fresh estimate of (``fresh``: every one of them, however
    recent: the job's steps contradict what the book says), all at once, and records the answers.
    A compnode that cannot probe costs only precision (its links keep the default figures; a dead one
    is found by the next step), and is not asked again for a while (``LinkBook.probe_failed``): each
    try costs a placement up to ``PROBE_TIMEOUT``. Returns whether anything was probed."""
    # One probe per pair of compnodes, however many sub-DAGs each holds (interleaved chunks): sent by
    # the sender's first sub-DAG, to the first sub-DAG of each compnode it feeds.
    first: dict[str, int] = {}
    for i, p in enumerate(peers):
        first.setdefault(p, i)
    wanted: dict[int, set[int]] = {}
    for i, targets in consumers.items():
        for c in targets:
            if peers[c] != peers[i] and book.needs_probe(peers[i], peers[c], fresh=fresh):
                wanted.setdefault(first[peers[i]], set()).add(first[peers[c]])
    calls, senders = [], []
    for i, to in sorted(wanted.items()):
        senders.append((i, sorted(to)))
        calls.append(call(peers[i], "probe_links", {"job_id": job_id, "to": sorted(to)}, PROBE_TIMEOUT))
    if not calls:
        return False
    started = time.monotonic()
    replies = await asyncio.gather(*calls, return_exceptions=True)
    for (i, to), reply in zip(senders, replies):
        if isinstance(reply, BaseException):
            log.warning("job %s: link probe from %s failed: %s", job_id, peers[i], reply)
            for c in to:
                book.probe_failed(peers[i], peers[c])
            continue
        for dst, (link, bound) in parse_probed_links(reply).items():
            if 0 <= dst < len(peers) and peers[dst] != peers[i]:
                book.record(peers[i], peers[dst], link, bound)
    log.info("job %s: links probed in %.3f s", job_id, time.monotonic() - started)
    return True
