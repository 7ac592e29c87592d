"""The caching tier: nginx ``proxy_cache`` with ``proxy_cache_lock`` from the documented
template (``nginx-cache.conf.template`` beside this file, docs/FLEET.md), started in a namespace
or on loopback, stopped by its pid."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time

TEMPLATE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "nginx-cache.conf.template")


def nginx_binary() -> "str | None":
    return shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


def render_config(root: str, listen: str, upstream_hostport: str, max_size: str = "8g") -> str:
    with open(TEMPLATE) as f:
        text = f.read()
    head, sep, body = text.partition("worker_processes")  # the comment names the placeholders
    for token, value in (("ROOT_DIR", root), ("LISTEN_ADDR", listen), ("UPSTREAM_ADDR", upstream_hostport),
                         ("MAX_SIZE", max_size)):
        body = body.replace(token, value)
    text = head + sep + body
    return text


class NginxCache:
    """One nginx cache: ``start()`` writes its config under ``root`` and runs it in the
    foreground (``daemon off``) so this object owns the process; ``stop()`` ends it."""

    def __init__(self, root: str, listen_host: str, listen_port: int, upstream_hostport: str, netns: "str | None" = None):
        self.root, self.host, self.port = root, listen_host, listen_port
        self.upstream = upstream_hostport
        self.netns = netns
        self.proc: "subprocess.Popen | None" = None

    @property
    def base_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, wait_s: float = 10.0) -> "NginxCache":
        binary = nginx_binary()
        if binary is None:
            raise RuntimeError("nginx is not installed (scripts/setup_env.sh installs nginx-light)")
        for d in ("cache", "tmp"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        conf = os.path.join(self.root, "nginx.conf")
        with open(conf, "w") as f:
            f.write(render_config(self.root, f"{self.host}:{self.port}", self.upstream))
        # Workers as root only here: the harness's dirs are private to root (a deployment runs
        # them as its own user, owning the cache dir).
        directives = "daemon off;" + (" user root;" if os.geteuid() == 0 else "")
        cmd = [binary, "-c", conf, "-p", self.root, "-g", directives]
        if self.netns:
            cmd = ["ip", "netns", "exec", self.netns] + cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                raise RuntimeError(f"nginx exited at start ({self.proc.returncode}): {err.strip()[:500]}")
            if self.netns is None and _port_open(self.host, self.port):
                return self
            if self.netns is not None and os.path.exists(os.path.join(self.root, "nginx.pid")):
                return self
            time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"nginx did not start listening on {self.host}:{self.port} within {wait_s}s")

    def cache_files(self) -> list[str]:
        out = []
        for d, _, files in os.walk(os.path.join(self.root, "cache")):
            out += [os.path.join(d, f) for f in files]
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)  # its own session: master and worker
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        if self.proc.stderr:
            self.proc.stderr.close()
        self.proc = None


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False
