"""Simulated hosts on one machine: network namespaces on a bridge, ``tc`` rate limits on both
ends of every link, nothing routed outside them.

Topology: a bridge in a namespace of its own; a source namespace and H host namespaces, each
joined to the bridge by a veth pair. A token bucket filter (tbf) on each end shapes a link:

- host side egress = the host's upload (b), bridge side egress = its download (b);
- the source's side egress = the source's aggregate rate (S).

Every name carries a tag unique to the run (``wsf<tag>-...``), so a test and a benchmark never
meet, and ``Fabric.close()`` (also on failure: a context manager) kills the processes it started,
by process group, then deletes every namespace it created.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time

FLEET_TBF_LATENCY = os.environ.get("FLEET_TBF_LATENCY", "200ms")
NS_PREFIX = "wsf"


class NamespaceRefused(RuntimeError):
    """The kernel (or the lack of root) refused network namespaces: the harness cannot run here."""


def sh(cmd: list[str], check: bool = True) -> str:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if check and r.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {r.stderr.strip()}")
    return r.stdout


def namespaces_usable() -> "tuple[bool, str]":
    """Whether this process may create a namespace, a veth pair and a tbf (with why not)."""
    if os.geteuid() != 0:
        return False, "network namespaces need root (ip netns add); run the harness as root"
    probe = f"{NS_PREFIX}probe{secrets.token_hex(2)}"
    try:
        r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    except FileNotFoundError:
        return False, "the ip command (iproute2) is not installed"
    if r.returncode:
        return False, f"the kernel refused a network namespace: {r.stderr.strip()}"
    try:
        r = subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "tbf",
                            "rate", "8mbit", "burst", "32kb", "latency", "50ms"], capture_output=True, text=True)
        if r.returncode:
            return False, f"tc refused a tbf qdisc: {r.stderr.strip()}"
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return True, ""


def our_namespaces(tag: "str | None" = None) -> list[str]:
    """The namespaces of this harness now present (of one run, with ``tag``)."""
    out = sh(["ip", "netns", "list"], check=False)
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    want = f"{NS_PREFIX}{tag}-" if tag else NS_PREFIX
    return [n for n in names if n.startswith(want)]


class Fabric:
    """The bridge, the source and ``hosts`` hosts; ``spawn`` runs a command in one of them."""

    BASE = "10.77"

    def __init__(self, hosts: int, host_mbit: float, src_mbit: float, tag: "str | None" = None):
        self.n = hosts
        self.host_mbit, self.src_mbit = host_mbit, src_mbit
        self.tag = tag or secrets.token_hex(2)
        self.created: list[str] = []
        self.procs: list[subprocess.Popen] = []

    # --- names and addresses ---------------------------------------------------------------

    @property
    def switch(self) -> str:
        return f"{NS_PREFIX}{self.tag}-sw"

    @property
    def source(self) -> str:
        return f"{NS_PREFIX}{self.tag}-src"

    def host(self, i: int) -> str:
        return f"{NS_PREFIX}{self.tag}-h{i}"

    @property
    def source_ip(self) -> str:
        return f"{self.BASE}.0.1"

    def host_ip(self, i: int) -> str:
        return f"{self.BASE}.{1 + i // 250}.{1 + i % 250}"

    # --- set-up and tear-down --------------------------------------------------------------

    def __enter__(self) -> "Fabric":
        try:
            self.up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def up(self) -> None:
        self._add_ns(self.switch)
        sh(["ip", "netns", "exec", self.switch, "ip", "link", "add", "br0", "type", "bridge"])
        sh(["ip", "netns", "exec", self.switch, "ip", "link", "set", "br0", "up"])
        self._join(self.source, "s", self.source_ip, self.src_mbit, None)
        for i in range(self.n):
            self._join(self.host(i), f"h{i}", self.host_ip(i), self.host_mbit, self.host_mbit)

    def _add_ns(self, ns: str) -> None:
        r = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
        if r.returncode:
            raise NamespaceRefused(f"ip netns add {ns}: {r.stderr.strip()}")
        self.created.append(ns)
        sh(["ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up"])

    def _join(self, ns: str, short: str, ip: str, up_mbit: "float | None", down_mbit: "float | None") -> None:
        self._add_ns(ns)
        a, b = f"v{self.tag}{short}a", f"v{self.tag}{short}b"  # at most 15 characters
        sh(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
        sh(["ip", "link", "set", a, "netns", ns])
        sh(["ip", "link", "set", b, "netns", self.switch])
        sh(["ip", "netns", "exec", ns, "ip", "addr", "add", f"{ip}/16", "dev", a])
        sh(["ip", "netns", "exec", ns, "ip", "link", "set", a, "up"])
        sh(["ip", "netns", "exec", self.switch, "ip", "link", "set", b, "master", "br0"])
        sh(["ip", "netns", "exec", self.switch, "ip", "link", "set", b, "up"])
        if up_mbit:
            self._shape(ns, a, up_mbit)
        if down_mbit:
            self._shape(self.switch, b, down_mbit)

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float) -> None:
        # A burst large enough for the veth's GSO super-packets; a long queue (the note's pilot:
        # 20 ms or 200 ms made no difference).
        sh(["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", "tbf",
            "rate", f"{mbit}mbit", "burst", "256kb", "latency", FLEET_TBF_LATENCY])

    def spawn(self, ns: str, cmd: list[str], **kw) -> subprocess.Popen:
        """``cmd`` in namespace ``ns``, in a process group of its own (killed by ``close``)."""
        p = subprocess.Popen(["ip", "netns", "exec", ns] + cmd, start_new_session=True, **kw)
        self.procs.append(p)
        return p

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 10
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                p.wait(timeout=10)
        # Anything else still inside (a process a command left behind): killed by its namespace's pids.
        for ns in self.created:
            for pid in sh(["ip", "netns", "pids", ns], check=False).split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
        for ns in reversed(self.created):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.created = []
