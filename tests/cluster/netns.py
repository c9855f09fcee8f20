"""Nodes on one machine: Linux network namespaces wired to a private bridge.

    fabric = Fabric.create()             # a switch namespace holding a bridge, 10.251.N.0/24
    gw = fabric.node("gw1")               # a namespace, its veth on the bridge, lo up
    proc = gw.spawn(["python", ...], log) # a process whose only network is that node's
    fabric.cut(gw) / fabric.mend(gw)      # the node's cable pulled (link down) and back
    gw.kill_all()                         # SIGKILL every process in the node
    fabric.close()                        # processes killed, namespaces and links gone

The bridge lives in a namespace of its own ("switch"), not in the host's: the host's
FORWARD chain may drop bridged traffic (Docker sets its policy to DROP and
br_netfilter passes bridged frames through it); a fresh namespace's chains are empty.
The host (the test process) is on the bridge too, at .1, so it can reach every node.
No node has a default route: nothing here can reach an outside address.

Every name starts with PREFIX and a per-run tag holding the creating process's id, so
two runs never collide and a run deletes what a dead run left (`clean_stale`), never a
live one's. Each fabric takes the first /24 of SUPERNET that no interface of the host
holds (under a lock), so concurrent runs (two suites at once) get separate subnets.
`close` is idempotent and registered with atexit, so namespaces go even when the test
process is interrupted.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import ipaddress
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from secrets import token_hex
from typing import IO, Any

PREFIX = "slc"  # every namespace and host link of this harness starts with it
SUPERNET = ipaddress.IPv4Network("10.251.0.0/16")  # private; never routed anywhere
FIRST_NODE = 10  # nodes get .10, .11, ... of their fabric's /24; the host .1
BRIDGE = "br0"
LOCK = Path(tempfile.gettempdir()) / "slc-fabric.lock"  # held while picking a subnet


class Unavailable(Exception):
    """Namespaces cannot be made here (not root, no iproute2, no permission)."""


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    # A netlink change waits for the kernel's RTNL lock, which a loaded machine (other
    # namespaces, other tests' sockets) can hold for long: the harness must not be what
    # fails there. Still bounded, so that a wedged `ip` ends the test.
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=300)


def unavailable() -> str | None:
    """Why namespaces cannot be made here, or None when they can (tried for real)."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}{_tag()}-probe"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


def _namespaces() -> list[str]:
    listed = _ip("netns", "list", check=False).stdout
    return [line.split()[0] for line in listed.splitlines() if line.strip()]


def _kill_namespace(ns: str) -> None:
    """SIGKILL every process in `ns`, wait until none is left (up to 10 s), delete it."""
    deadline = time.monotonic() + 10
    while True:
        pids = [int(p) for p in _ip("netns", "pids", ns, check=False).stdout.split()]
        if not pids or time.monotonic() > deadline:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)
    _ip("netns", "del", ns, check=False)


def _tag() -> str:
    """A run's tag: its process id (6 hex digits) and 2 random ones."""
    return f"{os.getpid():06x}{token_hex(1)}"


def _stale(name: str) -> bool:
    """Whether `name` is this harness's and the process that made it is gone."""
    if not name.startswith(PREFIX):
        return False
    try:
        pid = int(name[len(PREFIX):len(PREFIX) + 6], 16)
    except ValueError:
        return True
    if pid == os.getpid():
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


def clean_stale() -> list[str]:
    """Delete the namespaces and host links that dead runs of this harness left behind
    (their processes killed first); returns their names."""
    removed = [ns for ns in _namespaces() if _stale(ns)]
    for ns in removed:
        _kill_namespace(ns)
    for line in _ip("-o", "link", "show", check=False).stdout.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if _stale(name):
            _ip("link", "del", name, check=False)
            removed.append(name)
    return removed


def _free_subnet() -> ipaddress.IPv4Network:
    """The first /24 of SUPERNET that no interface of the host has an address in."""
    used = set()
    for line in _ip("-o", "-4", "addr", "show", check=False).stdout.splitlines():
        words = line.split()
        if "inet" in words:
            used.add(ipaddress.ip_interface(words[words.index("inet") + 1]).network)
    for subnet in SUPERNET.subnets(new_prefix=24):
        if not any(subnet.overlaps(u) for u in used):
            return subnet
    raise Unavailable(f"no free /24 left in {SUPERNET}")


@dataclass
class Node:
    """One namespace with one address on the bridge."""

    name: str
    ns: str
    address: str
    subnet: str  # the fabric's, e.g. 10.251.0.0/24
    port: str  # the switch side of its veth: what `cut` takes down
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def spawn(self, argv: Sequence[str], log: IO[bytes] | int, *, user: str | None = None,
              env: dict[str, str] | None = None, cwd: str | Path | None = None
              ) -> subprocess.Popen[bytes]:
        """Start `argv` inside this node (as `user` when given), output to `log`."""
        prefix = ["ip", "netns", "exec", self.ns]
        if user is not None:
            prefix += ["runuser", "-u", user, "--"]
        proc = subprocess.Popen([*prefix, *argv], stdout=log, stderr=log, env=env, cwd=cwd,
                                start_new_session=True)
        self.procs.append(proc)
        return proc

    def pids(self) -> list[int]:
        return [int(p) for p in _ip("netns", "pids", self.ns, check=False).stdout.split()]

    def kill_all(self) -> int:
        """SIGKILL every process in the node (as a power cut would); returns how many."""
        killed = 0
        deadline = time.monotonic() + 10
        while (pids := self.pids()) and time.monotonic() < deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
            time.sleep(0.05)
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5)
        self.procs = [p for p in self.procs if p.poll() is None]
        return killed

    def url(self, scheme: str, port: int, path: str = "") -> str:
        return f"{scheme}://{self.address}:{port}{path}"


class Fabric:
    """The switch namespace with its bridge, the host's leg on it, and the nodes."""

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.subnet = SUPERNET  # until _build_switch picks its /24
        self.switch = f"{PREFIX}{tag}-sw"
        self.host_link = f"{PREFIX}{tag}-h"
        self.nodes: dict[str, Node] = {}
        self._closed = False

    @classmethod
    def create(cls) -> Fabric:
        """A fresh fabric; stale ones of earlier runs are cleaned first."""
        clean_stale()
        fabric = cls(_tag())
        atexit.register(fabric.close)
        try:
            with LOCK.open("a") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)  # two runs must not pick one subnet
                fabric._build_switch()
        except BaseException:
            fabric.close()
            raise
        return fabric

    def _build_switch(self) -> None:
        self.subnet = _free_subnet()
        sw = self.switch
        _ip("netns", "add", sw)
        _ip("-n", sw, "link", "set", "lo", "up")
        _ip("-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _ip("-n", sw, "link", "set", BRIDGE, "up")
        # The host's leg: one end here with .1, the other a port of the bridge.
        _ip("link", "add", self.host_link, "type", "veth", "peer", "name", "hostport",
            "netns", sw)
        _ip("-n", sw, "link", "set", "hostport", "master", BRIDGE, "up")
        _ip("addr", "add", f"{self.subnet[1]}/{self.subnet.prefixlen}", "dev", self.host_link)
        _ip("link", "set", self.host_link, "up")

    def node(self, name: str) -> Node:
        """A new node: namespace, veth (eth0 inside, a bridge port outside), address."""
        if not name.isalnum() or len(name) > 6:
            raise ValueError(f"node name {name!r}: up to 6 letters and digits")
        address = str(self.subnet[FIRST_NODE + len(self.nodes)])
        ns = f"{PREFIX}{self.tag}-{name}"
        node = Node(name, ns, address, str(self.subnet), port=f"p-{name}")
        _ip("netns", "add", ns)
        self.nodes[name] = node
        _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", ns, "link", "add", "eth0", "type", "veth", "peer", "name", node.port,
            "netns", self.switch)
        _ip("-n", self.switch, "link", "set", node.port, "master", BRIDGE, "up")
        _ip("-n", ns, "addr", "add", f"{address}/{self.subnet.prefixlen}", "dev", "eth0")
        _ip("-n", ns, "link", "set", "eth0", "up")
        return node

    def cut(self, node: Node) -> None:
        """Pull the node's cable: its bridge port goes down, nothing passes either way
        (established connections see silence, not a reset)."""
        _ip("-n", self.switch, "link", "set", node.port, "down")

    def mend(self, node: Node) -> None:
        _ip("-n", self.switch, "link", "set", node.port, "up")

    def close(self) -> None:
        """Kill every node's processes, delete the namespaces and the host's link."""
        if self._closed:
            return
        self._closed = True
        for node in self.nodes.values():
            _kill_namespace(node.ns)
            for proc in node.procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(5)
        _kill_namespace(self.switch)  # its ports (the nodes' veth ends) go with it
        _ip("link", "del", self.host_link, check=False)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
