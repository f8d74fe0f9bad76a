"""Several "hosts" on one Linux machine: one network namespace per host, each with its own IP on a private
bridge, every link shaped with ``tc ... tbf`` on both ends (the multi-host test tier and
``benchmarks/links.py``).

Needs root and iproute2 (``ip netns``, ``tc``); ``unavailable()`` says why a machine cannot, so tests skip
with that reason. Everything a lab creates carries a unique tag (``fnlab-<pid>-<token>`` on namespaces,
the same as the link alias of the bridge and host-side veths), so ``NetLab.close()`` removes exactly its
own namespaces, veths and bridge (also when the body failed), and ``clean_leftovers()`` removes those of a
lab whose process died without closing (a SIGKILLed test run). Traffic stays on the bridge: the host has
no address on it, and nothing is routed out of it.

Programs run inside a host with ``lab.wrap(host) + argv`` (``ip netns exec NS argv``: the same process,
the environment kept), e.g. through ``processes.start_daemon(..., wrap=lab.wrap(host))``.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass, field

from fusionnet.errors import ExecutionError

NS_PREFIX = "fnlab"
_NS_RE = re.compile(rf"^{NS_PREFIX}-(\d+)-([0-9a-f]{{6}})-\d+$")
_ALIAS_RE = re.compile(rf"{NS_PREFIX}-(\d+)-([0-9a-f]{{6}})")
TBF_LATENCY = "200ms"  # queue bound of the shaper: deep enough that TCP at 20 Mbit/s does not starve


def unavailable() -> str | None:
    """Why network namespaces cannot be used here (None when they can)."""
    if os.name != "posix" or not hasattr(os, "geteuid"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns, veth, tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2's `{tool}` is not installed"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns list` failed: {probe.stderr.strip()[:200]}"
    return None


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise ExecutionError(f"`ip {' '.join(args)}` failed: {done.stderr.strip()}")
    return done


def _tc(*args: str) -> None:
    done = subprocess.run(["tc", *args], capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        raise ExecutionError(f"`tc {' '.join(args)}` failed: {done.stderr.strip()}")


def rate_bits(rate: str) -> float:
    """tc's rate syntax ("1gbit", "100mbit", "20mbit", "500kbit") in bits per second."""
    m = re.fullmatch(r"(\d+(?:\.\d+)?)([kmg]?)bit", rate.strip().lower())
    if m is None:
        raise ValueError(f"rate {rate!r}: expected NUMBER followed by bit, kbit, mbit or gbit")
    return float(m.group(1)) * {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}[m.group(2)]


def _shape(dev: str, rate: str, netns: str | None) -> None:
    # burst: 1 ms of traffic (>= 16 KiB): a bigger bucket lets a probe's few MB through at memory speed
    # and the link looks faster than it is (high-resolution timers keep the rate with a small bucket)
    burst = max(16384, int(rate_bits(rate) / 8 / 1000))
    cmd = ["qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst)]
    cmd += ["latency", TBF_LATENCY]
    _tc(*(["-n", netns] if netns else []), *cmd)


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ip: str
    veth_host: str  # the bridge's end
    veth_ns: str  # the namespace's end


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clean_leftovers() -> list[str]:
    """Removes the namespaces, veths and bridges of labs whose creating process is gone; returns names."""
    removed = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(name)
        if m and not _pid_alive(int(m.group(1))):
            _ip("netns", "delete", name, check=False)
            removed.append(name)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        m = _ALIAS_RE.search(line.split(" alias ")[-1]) if " alias " in line else None
        if m and not _pid_alive(int(m.group(1))):
            dev = line.split(":", 2)[1].strip().split("@")[0]
            _ip("link", "delete", dev, check=False)
            removed.append(dev)
    return removed


@dataclass
class NetLab:
    """``hosts`` namespaces on one bridge, each link limited to ``rate`` (tc syntax, None = unshaped) in
    both directions. Use as a context manager: ``with NetLab(3, "20mbit") as lab: lab.hosts[0].ip``."""

    n_hosts: int
    rate: str | None = None
    token: str = field(default_factory=lambda: secrets.token_hex(3))
    hosts: list[Host] = field(default_factory=list)
    _created: list[tuple[str, str]] = field(default_factory=list)  # ("netns"|"link", name), in order

    def __post_init__(self) -> None:
        if not 1 <= self.n_hosts <= 200:
            raise ValueError(f"a lab has 1..200 hosts, got {self.n_hosts}")
        if self.rate is not None:
            rate_bits(self.rate)  # validates now

    @property
    def tag(self) -> str:
        return f"{NS_PREFIX}-{os.getpid()}-{self.token}"

    @property
    def bridge(self) -> str:
        return f"fb{self.token}"

    @property
    def subnet(self) -> str:
        # One /24 per lab, from the token, so two labs at once do not overlap (nor usually a real LAN).
        return f"10.213.{int(self.token[:2], 16)}"

    def wrap(self, host: Host | int) -> list[str]:
        """argv prefix that runs a program inside ``host``."""
        h = self.hosts[host] if isinstance(host, int) else host
        return ["ip", "netns", "exec", h.netns]

    def create(self) -> NetLab:
        why = unavailable()
        if why is not None:
            raise ExecutionError(why)
        clean_leftovers()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            self._created.append(("link", self.bridge))
            _ip("link", "set", "dev", self.bridge, "alias", self.tag)
            _ip("link", "set", self.bridge, "up")
            for i in range(self.n_hosts):
                self.hosts.append(self._add_host(i))
        except BaseException:
            self.close()
            raise
        return self

    def _add_host(self, i: int) -> Host:
        host = Host(
            i, f"{self.tag}-{i}", f"{self.subnet}.{i + 1}", f"fv{self.token}h{i}", f"fv{self.token}n{i}"
        )
        _ip("netns", "add", host.netns)
        self._created.append(("netns", host.netns))
        _ip("link", "add", host.veth_host, "type", "veth", "peer", "name", host.veth_ns)
        self._created.append(("link", host.veth_host))
        _ip("link", "set", "dev", host.veth_host, "alias", self.tag)
        _ip("link", "set", host.veth_ns, "netns", host.netns)
        _ip("link", "set", host.veth_host, "master", self.bridge)
        _ip("link", "set", host.veth_host, "up")
        _ip("-n", host.netns, "addr", "add", f"{host.ip}/24", "dev", host.veth_ns)
        _ip("-n", host.netns, "link", "set", host.veth_ns, "up")
        _ip("-n", host.netns, "link", "set", "lo", "up")
        if self.rate is not None:
            _shape(host.veth_host, self.rate, None)  # towards the host
            _shape(host.veth_ns, self.rate, host.netns)  # from the host
        return host

    def set_rate(self, rate: str | None) -> None:
        """Re-shapes every link (None removes the shaping)."""
        for host in self.hosts:
            for dev, netns in ((host.veth_host, None), (host.veth_ns, host.netns)):
                if rate is None:
                    subprocess.run(
                        ["tc", *(["-n", netns] if netns else []), "qdisc", "del", "dev", dev, "root"],
                        capture_output=True,
                    )
                else:
                    _shape(dev, rate, netns)
        self.rate = rate

    def close(self) -> None:
        """Removes everything this lab created (idempotent; errors of one removal do not stop the rest)."""
        for kind, name in reversed(self._created):
            with contextlib.suppress(Exception):
                _ip("netns" if kind == "netns" else "link", "delete", name, check=False)
        self._created.clear()

    def run(
        self, host: Host | int, argv: Sequence[str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """Runs a short command inside ``host`` and returns its result (not checked)."""
        return subprocess.run([*self.wrap(host), *argv], capture_output=True, text=True, timeout=timeout)

    def __enter__(self) -> NetLab:
        return self.create()

    def __exit__(self, *exc: object) -> None:
        self.close()


def lab_resources(token: str) -> list[str]:
    """Names of namespaces and links that still carry ``token`` (empty once its lab is closed)."""
    found = [n.split()[0] for n in _ip("netns", "list", check=False).stdout.splitlines() if token in n]
    found += [
        line.split(":", 2)[1].strip().split("@")[0]
        for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
        if token in line
    ]
    return found
