"""The node's pod network: one Linux bridge with a private /24, one network namespace and
veth pair per pod.

    host netns                          pod netns (ip netns <prefix>p<n>)
    bridge <prefix>br  10.X.Y.1/24 ---- veth <prefix>v<n>  <=>  eth0 10.X.Y.n/24, lo
                       (DNS server)

Nothing is routed anywhere: pods get no default route (only the /24 is reachable: other
pods, and the bridge address where the cluster DNS listens), the host gets only the /24's
connected route on the bridge, forwarding and iptables are never touched. The /24 is
chosen under a lock among 10.231.0.0/16 so that it overlaps no route of the host, and
every name carries a per-node prefix so that a sweep (`sweep`) finds what a crashed run
left behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import signal
import subprocess
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

NAME_PREFIX = "dgn"  # every bridge, veth and netns of every node starts with it
LOCK_FILE = "/run/disagg-node.lock"
POOL = ipaddress.ip_network("10.231.0.0/16")


class NetworkError(RuntimeError):
    pass


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10)
    if check and result.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {result.stderr.strip()}")
    return result


def can_create_namespaces() -> str | None:
    """None when this process can build pod sandboxes, else why not (a skip reason)."""
    if os.geteuid() != 0:
        return "the node needs root (network, mount and IPC namespaces)"
    for tool in ("ip", "nsenter"):
        if not any(os.access(f"{d}/{tool}", os.X_OK) for d in os.get_exec_path()):
            return f"the node needs `{tool}` (iproute2 / util-linux)"
    probe = f"{NAME_PREFIX}probe{os.getpid() % 100000}"
    if ip("netns", "add", probe, check=False).returncode != 0:
        return "`ip netns add` fails here (no network namespaces)"
    ip("netns", "del", probe, check=False)
    return None


@contextlib.contextmanager
def _locked() -> Iterator[None]:
    with open(LOCK_FILE, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _used_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets = []
    for line in ip("-4", "route", "show", "table", "all").stdout.splitlines():
        word = line.split()[0] if line.split() else ""
        with contextlib.suppress(ValueError):
            if word not in ("default", "broadcast", "local", "unreachable"):
                nets.append(ipaddress.ip_network(word, strict=False))
    for line in ip("-4", "-o", "addr").stdout.splitlines():
        parts = line.split()
        if "inet" in parts:
            nets.append(ipaddress.ip_network(parts[parts.index("inet") + 1], strict=False))
    return nets


FIRST_HOST, LAST_HOST = 2, 250  # pod addresses in the /24 (.1 is the bridge's)


def next_host(last: int, used: set[int]) -> int | None:
    """The pod address (host number) to give out after `last`: the next one not `used`,
    round robin, as the host-local IPAM plugin does. A just-freed address is not reused
    while others are free: pods on the bridge keep neighbour (ARP) entries naming the gone
    pod's MAC, so for up to a minute they could not reach a new pod given its address (the
    TCP handshakes of relays to it stall until the entry ages out)."""
    span = LAST_HOST - FIRST_HOST + 1
    for step in range(1, span + 1):
        n = FIRST_HOST + (last - FIRST_HOST + step) % span
        if n not in used:
            return n
    return None


@dataclass
class Bridge:
    """The node's bridge and its address pool; `attach` gives a pod its namespace."""

    tag: str  # short, unique per node: part of every interface and netns name
    subnet: ipaddress.IPv4Network = field(init=False)
    _last: int = field(default=FIRST_HOST - 1, init=False)  # the address given out last
    _used: set[int] = field(default_factory=set, init=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False)

    @property
    def name(self) -> str:
        return f"{NAME_PREFIX}{self.tag}br"

    @property
    def gateway(self) -> str:
        return str(self.subnet.network_address + 1)

    def create(self) -> None:
        with _locked():
            used = _used_networks()
            for candidate in POOL.subnets(new_prefix=24):
                if not any(candidate.overlaps(n) for n in used):
                    self.subnet = ipaddress.IPv4Network(candidate)
                    break
            else:
                raise NetworkError(f"no free /24 left in {POOL}")
            ip("link", "add", self.name, "type", "bridge")
            ip("addr", "add", f"{self.gateway}/24", "dev", self.name)
            ip("link", "set", self.name, "up")

    def delete(self) -> None:
        ip("link", "del", self.name, check=False)

    def attach(self, netns: str) -> tuple[str, str]:
        """Create netns `netns` with eth0 on the bridge; returns (pod IP, host veth)."""
        with self._lock:
            n = next_host(self._last, self._used)
            if n is None:
                raise NetworkError("the node's /24 is full")
            self._last = n
            self._used.add(n)
        veth = f"{NAME_PREFIX}{self.tag}v{n}"
        address = str(self.subnet.network_address + n)
        ip("netns", "add", netns)
        ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", netns)
        ip("link", "set", veth, "master", self.name, "up")
        ip("-n", netns, "addr", "add", f"{address}/24", "dev", "eth0")
        ip("-n", netns, "link", "set", "eth0", "up")
        ip("-n", netns, "link", "set", "lo", "up")
        return address, veth

    def detach(self, netns: str, veth: str, address: str) -> None:
        ip("link", "del", veth, check=False)
        ip("netns", "del", netns, check=False)
        # the host's neighbour entry names the gone pod's MAC: a pod given this address next
        # would be unreachable from the host (probes, scrapes) until that entry ages out
        ip("neigh", "flush", "to", address, "dev", self.name, check=False)
        n = int(ipaddress.ip_address(address)) - int(self.subnet.network_address)
        with self._lock:
            self._used.discard(n)


def cut(netns: str) -> None:
    """Take a pod off the network (its eth0 down): peers see timeouts, not refusals."""
    ip("-n", netns, "link", "set", "eth0", "down")


def restore(netns: str) -> None:
    ip("-n", netns, "link", "set", "eth0", "up")


def processes_in(netns_path: str) -> list[int]:
    """PIDs whose network namespace is the one at `netns_path` (a pod's processes)."""
    try:
        inode = os.stat(netns_path).st_ino
    except OSError:
        return []
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError):
                if os.stat(f"/proc/{entry}/ns/net").st_ino == inode:
                    found.append(int(entry))
    return found


def leftovers(tag: str = "") -> list[str]:
    """Interfaces and network namespaces of a node (`tag`; every node if empty)."""
    prefix = NAME_PREFIX + tag
    found = [f"netns {n.split()[0]}" for n in ip("netns", "list").stdout.splitlines() if n]
    found = [f for f in found if f.split()[1].startswith(prefix)]
    for line in ip("-o", "link").stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0]
        if name.startswith(prefix):
            found.append(f"link {name}")
    return found


def sweep(tag: str = "") -> list[str]:
    """Kill every process in a node's network namespaces, delete the namespaces and the
    interfaces; returns what was there."""
    found = leftovers(tag)
    for item in found:
        kind, name = item.split(" ", 1)
        if kind == "netns":
            for pid in processes_in(f"/run/netns/{name}"):
                found.append(f"process {pid}")
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
    for item in found:
        kind, name = item.split(" ", 1)
        if kind == "link":
            ip("link", "del", name, check=False)
        elif kind == "netns":
            ip("netns", "del", name, check=False)
    return found
