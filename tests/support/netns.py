"""Hosts on one machine, networked for real: Linux network namespaces on a bridge.

``Network(session)`` makes a bridge with the data host's address (``x.x.x.1``: this machine's
own namespace, where the test's PostgreSQL and Redis run on loopback) and ``add_host(name)``
makes a namespace with a veth pair on that bridge and an address of its own (``.2``, ``.3``
…): a process started in it (``Host.command``) reaches the others only across the bridge,
at their addresses. ``publish(port)`` forwards the data host's address and ``port`` to the
same port on loopback (iptables DNAT, and SNAT to loopback, so PostgreSQL's ``pg_hba``
sees a local client), as a data host's firewall would open its services to the hosts.

Faults: ``Host.kill_all()`` (every process of the host, SIGKILL: the host is gone),
``Host.cut(port)`` / ``Host.uncut(port)`` (the host's packets to the data host's ``port``
are dropped: its connections hang as across a broken network, then time out).

Everything is named after the test session (``ipt<session>…``), so a run removes what a
killed earlier run of its session left, and two sessions never meet. Root only, and needs
``ip`` (iproute2) and ``iptables``: ``unavailable()`` says why not, for a skip.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from dataclasses import dataclass, field


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (CI runs as root)"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed (Debian: iproute2, iptables; .ci/run installs them)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"ip netns does not work here: {probe.stderr.strip()}"
    return None


def _run(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(list(args), capture_output=True, text=True, timeout=30)
    if check and result.returncode != 0:
        raise RuntimeError(f"{' '.join(args)}: {result.stderr.strip() or result.stdout.strip()}")
    return result


@dataclass
class Host:
    name: str
    namespace: str
    address: str
    data_address: str

    def command(self, argv: list[str]) -> list[str]:
        """``argv`` run inside this host (its network namespace)."""
        return ["ip", "netns", "exec", self.namespace, *argv]

    def pids(self) -> list[int]:
        result = _run("ip", "netns", "pids", self.namespace, check=False)
        return [int(p) for p in result.stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process of the host (the machine is gone). How many there were."""
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return len(pids)

    def cut(self, port: int) -> None:
        """Drop this host's packets to the data host's ``port`` (a partition, not a refusal)."""
        _run(*self._rule("-A", port))

    def uncut(self, port: int) -> None:
        _run(*self._rule("-D", port), check=False)

    def _rule(self, action: str, port: int) -> list[str]:
        return self.command(["iptables", action, "OUTPUT", "-p", "tcp", "-d", self.data_address,
                             "--dport", str(port), "-j", "DROP"])  # fmt: skip


@dataclass
class Network:
    session: int
    hosts: dict[str, Host] = field(default_factory=dict)
    published: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.prefix = f"ipt{self.session}"
        self.bridge = f"{self.prefix}br"
        self.subnet = f"10.231.{50 + self.session}"
        self.data_address = f"{self.subnet}.1"
        self.chain = f"IPT{self.session}"

    def __enter__(self) -> Network:
        self.remove()  # what a killed earlier run of this session left
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.data_address}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        _run("sysctl", "-q", "-w", f"net.ipv4.conf.{self.bridge}.route_localnet=1")
        _run("iptables", "-t", "nat", "-N", f"{self.chain}-IN")
        _run("iptables", "-t", "nat", "-N", f"{self.chain}-LO")
        _run("iptables", "-t", "nat", "-A", "PREROUTING", "-i", self.bridge, "-j", f"{self.chain}-IN")
        _run("iptables", "-t", "nat", "-A", "INPUT", "-s", f"{self.subnet}.0/24", "-j", f"{self.chain}-LO")
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def add_host(self, name: str) -> Host:
        index = len(self.hosts) + 2
        namespace, outer, inner = f"{self.prefix}-{name}", f"{self.prefix}h{index}", f"{self.prefix}h{index}p"
        address = f"{self.subnet}.{index}"
        _run("ip", "netns", "add", namespace)
        _run("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        _run("ip", "link", "set", inner, "netns", namespace)
        _run("ip", "link", "set", outer, "master", self.bridge, "up")
        _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", inner)
        _run("ip", "-n", namespace, "link", "set", inner, "up")
        _run("ip", "-n", namespace, "link", "set", "lo", "up")
        _run("ip", "-n", namespace, "route", "add", "default", "via", self.data_address)
        host = Host(name=name, namespace=namespace, address=address, data_address=self.data_address)
        self.hosts[name] = host
        return host

    def publish(self, port: int) -> None:
        """Hosts reach ``data_address:port`` as this machine's ``127.0.0.1:port``."""
        _run("iptables", "-t", "nat", "-A", f"{self.chain}-IN", "-p", "tcp", "-d", self.data_address,
             "--dport", str(port), "-j", "DNAT", "--to-destination", f"127.0.0.1:{port}")  # fmt: skip
        _run("iptables", "-t", "nat", "-A", f"{self.chain}-LO", "-p", "tcp", "-d", "127.0.0.1",
             "--dport", str(port), "-j", "SNAT", "--to-source", "127.0.0.1")  # fmt: skip
        self.published.append(port)

    def remove(self) -> None:
        """Every process of the session's hosts killed; namespaces, bridge and rules removed."""
        listed = _run("ip", "netns", "list", check=False).stdout.split("\n")
        for line in listed:
            namespace = line.split(" ", 1)[0]
            if namespace.startswith(f"{self.prefix}-"):
                for pid in _run("ip", "netns", "pids", namespace, check=False).stdout.split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                _run("ip", "netns", "del", namespace, check=False)
        _run("ip", "link", "del", self.bridge, check=False)
        _run("iptables", "-t", "nat", "-D", "PREROUTING", "-i", self.bridge, "-j", f"{self.chain}-IN", check=False)
        _run("iptables", "-t", "nat", "-D", "INPUT", "-s", f"{self.subnet}.0/24", "-j", f"{self.chain}-LO",
             check=False)  # fmt: skip
        for chain in (f"{self.chain}-IN", f"{self.chain}-LO"):
            _run("iptables", "-t", "nat", "-F", chain, check=False)
            _run("iptables", "-t", "nat", "-X", chain, check=False)
        self.hosts.clear()
        self.published.clear()
