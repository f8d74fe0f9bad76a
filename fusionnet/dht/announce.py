"""Announcing our record and looking up everyone else's, under well-known DHT keys.

Each role has one key; each peer writes under its own subkey ``<peer id>[owner:<RSA public key>]``.
hivemind's ``RSASignatureValidator`` (used by every FusionNet DHT node) then refuses any write to that
subkey not signed by the owner, so no peer can overwrite or fake-expire another peer's record. The owner
key is the peer's libp2p identity (``identity.py``), so a lookup recomputes the peer id from the owner
key and ignores a record that claims any other peer id: a fake OFFLINE or broker record written by
another peer for a victim's id is never seen. Times come from the DHT's expiration of the record: the
``updated_at`` a peer claims is clamped into ``[expires_at - max_ttl, min(now, expires_at)]``, and a
record that expires more than ``max_ttl`` from now is ignored (it could not have come from a peer that
refreshes on schedule). Records
expire on their own (``ttl``, normally 3 refresh periods), so a peer that vanishes without saying goodbye
disappears from lookups; a peer that leaves gracefully writes an OFFLINE record first.

Lookups never fail because of one bad record: malformed entries are skipped with one log line each.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Generic

import hivemind
from hivemind.dht.crypto import RSASignatureValidator
from hivemind.utils import get_dht_time

from fusionnet.dht.identity import owner_peer_id
from fusionnet.dht.records import BrokerRecord, CompnodeRecord, R, decode_record, encode_record
from fusionnet.errors import WireError

log = logging.getLogger("fusionnet.dht.announce")

COMPNODES_KEY = "fusionnet/v1/compnodes"
BROKERS_KEY = "fusionnet/v1/brokers"
KEYS: dict[type, str] = {CompnodeRecord: COMPNODES_KEY, BrokerRecord: BROKERS_KEY}
_MAX_REMEMBERED_BAD = 4096
# A record may live this long at most (the daemons' default ttl is 3 refresh periods, well under it).
DEFAULT_MAX_TTL = 3600.0


@dataclass(frozen=True)
class Found(Generic[R]):
    """A record found in the DHT with its expiration (DHT time) and its owner's key marker."""

    record: R
    expires_at: float
    owner: bytes


class Announcer:
    """Stores this peer's record and reads everyone's, over a running ``hivemind.DHT``."""

    def __init__(
        self,
        dht: hivemind.DHT,
        validator: RSASignatureValidator,
        peer_id: str,
        max_ttl: float = DEFAULT_MAX_TTL,
    ):
        self.dht = dht
        self.peer_id = peer_id
        self.max_ttl = max_ttl
        self.subkey = peer_id.encode() + validator.local_public_key
        self._reported_bad: set[tuple[bytes, float]] = set()

    async def announce(self, record: CompnodeRecord | BrokerRecord, ttl: float) -> bool:
        """Writes ``record`` (stamped with the current DHT time) to expire in ``ttl`` seconds. Returns whether
        at least one DHT node accepted it."""
        assert record.peer_id == self.peer_id, "a peer may only announce its own record"
        now = get_dht_time()
        stamped = encode_record(record.model_copy(update={"updated_at": now}))
        key = KEYS[type(record)]
        if await self.dht.store(key, stamped, now + ttl, subkey=self.subkey, return_future=True):
            return True
        # The DHT keeps whichever value expires last, so a record from our previous run (same identity, e.g.
        # one announced with a longer ttl) can outrank this one: outlive it by a hair and store again.
        found = await self.dht.get(key, latest=True, return_future=True)
        previous = (
            found.value.get(self.subkey) if found is not None and isinstance(found.value, dict) else None
        )
        if previous is None or previous.expiration_time < now + ttl:
            return False
        expiration = previous.expiration_time + 0.5
        return bool(await self.dht.store(key, stamped, expiration, subkey=self.subkey, return_future=True))

    async def lookup(self, cls: type[R]) -> list[Found[R]]:
        """All unexpired records of one kind, one per peer id (the newest when a peer id appears under two
        owner keys), sorted by peer id."""
        key = KEYS[cls]
        found = await self.dht.get(key, latest=True, return_future=True)
        if found is None or not isinstance(found.value, dict):
            return []
        best: dict[str, Found[R]] = {}
        now = get_dht_time()
        for subkey, item in sorted(found.value.items(), key=lambda kv: repr(kv[0])):
            entry = self._parse(cls, key, subkey, item, now)
            if entry is None:
                continue
            other = best.get(entry.record.peer_id)
            if other is None or entry.expires_at > other.expires_at:  # only its owner could write either
                best[entry.record.peer_id] = entry
        return [best[p] for p in sorted(best)]

    def _parse(self, cls: type[R], key: str, subkey: object, item: object, now: float) -> Found[R] | None:
        value = getattr(item, "value", None)
        expires_at = float(getattr(item, "expiration_time", 0.0))
        try:
            if not isinstance(subkey, bytes) or b"[owner:" not in subkey or not subkey.endswith(b"]"):
                raise WireError(f"{key}: unsigned subkey {subkey!r:.60}")
            claimed, _, rest = subkey.partition(b"[owner:")
            record = decode_record(cls, value, f"{key}[{claimed.decode(errors='replace')[:60]}]")
            if claimed != record.peer_id.encode():
                raise WireError(
                    f"{key}: record for peer {record.peer_id} stored under subkey of {claimed!r:.60}"
                )
            owner = owner_peer_id(rest[:-1])
            if owner != record.peer_id:
                raise WireError(
                    f"{key}: record for peer {record.peer_id} is signed by "
                    f"{'an invalid key' if owner is None else 'peer ' + owner}, not by that peer"
                )
            if expires_at > now + self.max_ttl:
                raise WireError(
                    f"{key}: record of {record.peer_id} expires in {expires_at - now:.0f} s, "
                    f"beyond the {self.max_ttl:.0f} s a record may live"
                )
        except WireError as e:
            marker = (subkey if isinstance(subkey, bytes) else repr(subkey).encode(), expires_at)
            if marker not in self._reported_bad:  # one line per bad entry, not one per refresh
                if len(self._reported_bad) >= _MAX_REMEMBERED_BAD:
                    self._reported_bad.clear()
                self._reported_bad.add(marker)
                log.warning("skipping malformed DHT record: %s", e)
            return None
        # The peer's own claim of when it announced is bounded by what the DHT says about its record.
        stamped = min(max(record.updated_at, expires_at - self.max_ttl), now, expires_at)
        if stamped != record.updated_at:
            record = record.model_copy(update={"updated_at": stamped})
        return Found(record=record, expires_at=expires_at, owner=b"[owner:" + rest)
