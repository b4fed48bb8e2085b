"""Several machines for one test: Linux network namespaces joined by a bridge.

:class:`Network` makes a private network for one test: a *switch* namespace that holds a
bridge, and one namespace per host (:meth:`Network.add_host`), each with a loopback interface
and an ``eth0`` (a veth pair whose other end is a port of the bridge) addressed in
``10.77.0.0/24``.  Nothing is added to the machine's own namespace: no interface, no address,
no route, so parallel test runs (other checkouts, other engineers) cannot collide, and multicast
(DNS-SD) stays on the bridge.  Processes run inside a host with ``ip netns exec``
(:meth:`Host.spawn_twistd`); the test talks to them over Unix sockets in its own temporary
folder, which every namespace shares.

Everything made is removed when the test ends, whether it passed or not: the processes first,
then the namespaces (deleting a namespace deletes its interfaces and the bridge).  Namespaces
left by a run that was killed before its cleanup (their names carry its process id) are removed
by the next run.

:func:`unavailable` says why this machine cannot run such tests (not root, no ``ip``, no
namespaces or no bridges in this kernel or container); the tests skip with that reason.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from pathlib import Path

from twisted.internet import reactor
from twisted.trial.unittest import TestCase

from tests.processes import TWISTD, Child, child_env

SUBNET = "10.77.0"
"""The hosts' addresses are SUBNET.1, SUBNET.2, ... /24 (inside the namespaces only)."""
PREFIX = "sfnt"
_serial = itertools.count(1)
_probed: str | bool | None = False


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run ``ip ARGS``; raises RuntimeError with ip's own message when it fails and ``check``."""
    done = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
    if check and done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip() or done.returncode}")
    return done


def _remove_stale() -> None:
    """Delete namespaces of earlier runs whose process is gone (killed before its cleanup)."""
    listing = _ip("netns", "list", check=False).stdout
    for line in listing.splitlines():
        name = line.split()[0] if line.split() else ""
        parts = name.split("-")
        if len(parts) < 3 or parts[0] != PREFIX or not parts[1].isdigit():
            continue
        pid = int(parts[1])
        if pid != os.getpid() and not Path(f"/proc/{pid}").exists():
            _ip("netns", "del", name, check=False)


def unavailable() -> str | None:
    """Why network-namespace tests cannot run here, or None when they can (probed once)."""
    global _probed
    if _probed is not False:
        return _probed if isinstance(_probed, str) else None
    reason: str | None = None
    if not sys.platform.startswith("linux"):
        reason = "network namespaces are Linux only"
    elif os.geteuid() != 0:
        reason = "making network namespaces needs root (CI runs as root)"
    elif shutil.which("ip") is None:
        reason = "the ip command (iproute2) is not installed"
    else:
        name = f"{PREFIX}-{os.getpid()}-probe"
        try:
            _remove_stale()
            _ip("netns", "add", name)
            try:
                _ip("-n", name, "link", "add", "name", "br0", "type", "bridge")
                _ip("-n", name, "link", "add", "name", "va", "type", "veth", "peer", "name", "vb")
            finally:
                _ip("netns", "del", name, check=False)
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
            reason = f"cannot make network namespaces, bridges and veth pairs here: {e}"
    _probed = reason if reason is not None else None
    return reason


class Host:
    """One machine of a :class:`Network`: a namespace with ``lo`` and ``eth0`` at ``address``."""

    def __init__(self, network: Network, name: str, namespace: str, address: str) -> None:
        self.network = network
        self.name = name
        self.namespace = namespace
        self.address = address

    def spawn_twistd(self, child: Child, args: list[str]) -> Child:
        """Start ``twistd --pidfile= -n ARGS`` inside this host, in a fresh folder of the test;
        the test's cleanup kills it (before the namespaces go)."""
        test = self.network.test
        folder = Path(test.mktemp())
        folder.mkdir(parents=True)
        ip = shutil.which("ip") or "ip"
        argv = [ip, "netns", "exec", self.namespace, sys.executable, "-c", TWISTD,
                "--pidfile=", "-n", *args]  # fmt: skip
        # ip netns exec replaces itself with the program, so signals reach twistd directly.
        child.transport = reactor.spawnProcess(child, ip, argv, env=child_env(), path=str(folder))
        test.addCleanup(self._record, child, folder)
        test.addCleanup(child.kill)
        return child

    def _record(self, child: Child, folder: Path) -> None:
        """Keep what the process printed in its folder (``output.log``), to read after a failure."""
        (folder / "output.log").write_bytes(bytes(child.output))

    def __repr__(self) -> str:
        return f"<Host {self.name} {self.address} in {self.namespace}>"


class Network:
    """A bridge in a namespace of its own, and hosts plugged into it (see the module)."""

    def __init__(self, test: TestCase) -> None:
        reason = unavailable()
        if reason is not None:
            raise RuntimeError(reason)
        self.test = test
        self.prefix = f"{PREFIX}-{os.getpid()}-{next(_serial)}"
        self.hosts: list[Host] = []
        self._namespaces: list[str] = []
        # Registered first, so it runs last: after the processes of every host are killed.
        test.addCleanup(self.remove)
        self.switch = self._namespace("sw")
        _ip("-n", self.switch, "link", "add", "name", "br0", "type", "bridge")
        # 224.0.0.251 (mDNS) is link-local and flooded anyway; no snooping keeps it simple.
        _ip("-n", self.switch, "link", "set", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", self.switch, "link", "set", "br0", "up")

    def _namespace(self, suffix: str) -> str:
        name = f"{self.prefix}-{suffix}"
        _ip("netns", "add", name)
        self._namespaces.append(name)
        _ip("-n", name, "link", "set", "lo", "up")
        return name

    def add_host(self, name: str) -> Host:
        """A new host on the bridge, at the next address of the subnet."""
        number = len(self.hosts) + 1
        namespace = self._namespace(f"h{number}")
        port = f"p{number}"
        # Made inside the switch namespace and moved: no name ever appears in the machine's own.
        _ip("-n", self.switch, "link", "add", "name", port, "type", "veth", "peer", "name", "eth0",
            "netns", namespace)  # fmt: skip
        _ip("-n", self.switch, "link", "set", port, "master", "br0")
        _ip("-n", self.switch, "link", "set", port, "up")
        address = f"{SUBNET}.{number}"
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        host = Host(self, name, namespace, address)
        self.hosts.append(host)
        return host

    def remove(self) -> None:
        """Delete every namespace made (and so its interfaces and the bridge)."""
        namespaces, self._namespaces = self._namespaces, []
        for name in reversed(namespaces):
            _ip("netns", "del", name, check=False)
