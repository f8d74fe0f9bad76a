"""Which address a compnode's data path listens on and which it announces, so that other hosts can reach
it by default.

- ``--data-host HOST`` (a specific address or name): listen on it and announce it.
- ``--data-host 0.0.0.0`` / ``::``, or no ``--data-host``: the announced host comes from the first
  ``--announce-maddrs`` (a NAT or DNS name is announced, the data path listens on every interface), else
  from a specific ``--host-maddrs`` address (listened on), else, when libp2p listens on every interface,
  from the first non-loopback address libp2p sees on this machine (found at start-up). Only a compnode
  whose libp2p address is loopback (the default: one machine) gets 127.0.0.1.
- A wildcard listen is IPv6's ``::`` (dual-stack: IPv4 peers too) when the announced host is IPv6 (an
  ``/ip6/`` or ``/dns6/`` announce address, or one libp2p may find on an ``/ip6/`` listen address) or
  ``--data-host ::`` asks for it, else IPv4's ``0.0.0.0``: a data path that listens on IPv4 only while
  it announces an IPv6 host refuses every peer, which then falls back to the slower libp2p streams.
- A loopback ``--data-host`` in a swarm of several machines (a non-loopback ``--host-maddrs``,
  ``--announce-maddrs`` or ``--initial-peers``) is refused at start-up: peers would dial themselves.

``useful_maddrs`` is what the address file and the DHT record list: loopback multiaddrs only when there is
nothing else (a daemon listening on loopback only), since other machines cannot use them.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from dataclasses import dataclass

ANY4, ANY6 = "0.0.0.0", "::"


def maddr_host(maddr: str) -> str | None:
    """The host of /ip4/H, /ip6/H or /dns*/H multiaddrs (None for other forms)."""
    parts = maddr.split("/")
    if len(parts) > 2 and parts[1] in ("ip4", "ip6", "dns", "dns4", "dns6"):
        return parts[2]
    return None


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return host == "localhost"  # any other DNS name is for other machines


def is_ipv6(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).version == 6
    except ValueError:
        return False


def is_ipv6_maddr(maddr: str) -> bool:
    """An /ip6/ or /dns6/ multiaddr: its host is reached over IPv6."""
    return maddr.split("/")[1:2] in (["ip6"], ["dns6"])


def is_unspecified(host: str) -> bool:
    try:
        return ipaddress.ip_address(host.strip("[]")).is_unspecified
    except ValueError:
        return False


def useful_maddrs(maddrs: Sequence[str]) -> list[str]:
    """The multiaddrs other hosts can use: drops loopback (and unspecified) ones unless only loopback ones
    exist (a daemon listening on loopback)."""
    hosts = [(m, maddr_host(m)) for m in maddrs]
    keep = [m for m, h in hosts if h is None or not (is_loopback(h) or is_unspecified(h))]
    return sorted(keep) if keep else sorted(m for m, h in hosts if h is None or not is_unspecified(h))


def first_reachable_host(maddrs: Sequence[str], ipv4_only: bool = False) -> str | None:
    """The first host of ``maddrs`` that another machine could dial (not loopback, not unspecified);
    ``ipv4_only``: not an IPv6 one either (a data path listening on 0.0.0.0 cannot be reached there)."""
    for m in maddrs:
        host = maddr_host(m)
        if host is None or is_loopback(host) or is_unspecified(host):
            continue
        if ipv4_only and (is_ipv6(host) or is_ipv6_maddr(m)):
            continue
        return host
    return None


@dataclass(frozen=True)
class DataAddress:
    """Where the data path listens, and the host it announces (None: found from libp2p's addresses)."""

    listen: str
    announce: str | None
    multi_host: bool = False  # the swarm spans machines (flags name non-loopback addresses)


def data_address(
    data_host: str | None,
    host_maddrs: Sequence[str],
    announce_maddrs: Sequence[str],
    initial_peers: Sequence[str] = (),
) -> DataAddress:
    """Decides the data path's addresses from the flags; ``ValueError`` for a contradictory combination."""
    hosts = [maddr_host(m) for m in (*host_maddrs, *announce_maddrs, *initial_peers)]
    multi_host = any(h is not None and not is_loopback(h) for h in hosts)
    if data_host is not None and not data_host.strip():
        raise ValueError("--data-host must not be empty")
    if data_host is not None and not is_unspecified(data_host):
        if is_loopback(data_host) and multi_host:
            raise ValueError(
                f"--data-host {data_host} is a loopback address, but this compnode joins a swarm across "
                "machines (--host-maddrs / --announce-maddrs / --initial-peers are not loopback): other "
                "compnodes could not reach its data path. Give this machine's LAN or public address, or "
                "leave --data-host out to announce the one of --announce-maddrs / --host-maddrs"
            )
        return DataAddress(listen=data_host, announce=data_host, multi_host=multi_host)
    wants_v6 = data_host is not None and is_ipv6(data_host)  # --data-host ::
    for m in announce_maddrs:
        host = maddr_host(m)
        if host is not None and not is_unspecified(host):
            # A NAT / DNS name need not be a local address: listen on every one, of the announced family.
            wildcard = ANY6 if wants_v6 or is_ipv6(host) or is_ipv6_maddr(m) else ANY4
            listen = host if is_loopback(host) else wildcard
            return DataAddress(listen=listen, announce=host, multi_host=multi_host)
    specific = [h for h in (maddr_host(m) for m in host_maddrs) if h is not None and not is_unspecified(h)]
    reachable = [h for h in specific if not is_loopback(h)]
    if reachable:
        return DataAddress(listen=reachable[0], announce=reachable[0], multi_host=multi_host)
    binds_all = data_host is not None or any(is_unspecified(maddr_host(m) or "") for m in host_maddrs)
    if not multi_host and not binds_all:
        return DataAddress(listen="127.0.0.1", announce="127.0.0.1", multi_host=False)  # one machine
    # Take what libp2p sees (``announced_host``): an IPv6 address where it listens on one.
    wildcard = ANY6 if wants_v6 or any(is_ipv6_maddr(m) for m in host_maddrs) else ANY4
    return DataAddress(listen=wildcard, announce=None, multi_host=multi_host)


def announced_host(address: DataAddress, visible_maddrs: Sequence[str]) -> str:
    """The host to announce once libp2p is up: the decided one, else the first address of this machine
    that other hosts can dial (loopback only for a swarm on one machine); ``ValueError`` if none."""
    if address.announce is not None:
        return address.announce
    host = first_reachable_host(visible_maddrs, ipv4_only=address.listen == ANY4)
    if host is not None:
        return host
    if not address.multi_host:
        return "127.0.0.1"
    raise ValueError(
        "cannot tell which address other machines reach this compnode's data path at (libp2p sees only "
        f"{', '.join(visible_maddrs) or 'no addresses'}): set --data-host or --announce-maddrs"
    )
