"""Launch a real sglang server on the CPU (0.5.23; 0.5.16 from its own venv), on loopback, for
tests and the demo.

Role: one small class, ``SglangCpuServer``, that starts ``python -m sglang.launch_server`` (or
``sglang serve``, ``entrypoint="serve"``) with
the settings a 2-core CPU machine needs (CPU engine, torch-native attention, no CUDA graphs, a
small KV pool), waits until ``/health`` answers, and stops the whole process tree with SIGTERM.

Invariants:
- Loopback only: the server binds 127.0.0.1; ports are free ports picked on 127.0.0.1.
- The server's interpreter is this one unless ``python=`` or ``$WEIGHTSYNC_SGLANG_PYTHON`` names
  another venv's (the version matrix: ``make test-sglang0516``); the tests stay in this one.
- ``tests/cpu_scaffolding`` (import-only stand-ins for ``sgl_kernel``/``torchvision``) and the repo
  root are put on the server's ``PYTHONPATH``; this repo's sglang plugin is picked up through its
  installed entry point, exactly as in production.
- Everything the server prints goes to ``log_path`` (``log_text()`` reads it back); a server that
  dies while starting raises ``ServerStartError`` with the log's tail.
- ``bind_mounts`` runs the server in its own mount namespace (``unshare -m`` + bind mounts, needs
  root) so that one path names a different directory per simulated node.
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import requests

REPO_ROOT = Path(__file__).resolve().parent.parent
CPU_SCAFFOLDING_DIR = REPO_ROOT / "tests" / "cpu_scaffolding"
LOOPBACK = "127.0.0.1"
SGLANG_PYTHON_ENV = "WEIGHTSYNC_SGLANG_PYTHON"


class ServerStartError(RuntimeError):
    """The sglang server exited or did not become healthy in time."""


def find_free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


def server_python(python: str | os.PathLike | None = None) -> str:
    """The interpreter that runs the server: ``python``, else ``$WEIGHTSYNC_SGLANG_PYTHON`` (the
    version-matrix run points it at another venv's sglang), else this interpreter. A relative
    path is taken from the repository root."""
    chosen = python or os.environ.get(SGLANG_PYTHON_ENV) or sys.executable
    path = Path(chosen)
    if not path.is_absolute():
        path = REPO_ROOT / path
    if not os.access(path, os.X_OK):
        raise FileNotFoundError(
            f"the sglang server interpreter {path} (python argument or ${SGLANG_PYTHON_ENV}) is "
            "not an executable file; `make setup` builds the venvs"
        )
    return str(path)


def cpu_server_env(*, parallel: int = 1, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Environment for an sglang CPU server process (``parallel`` = tp * dp * pp ranks per node)."""
    env = dict(os.environ)
    env["SGLANG_USE_CPU_ENGINE"] = "1"
    paths = [str(CPU_SCAFFOLDING_DIR), str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    if parallel > 1 and "SGLANG_CPU_OMP_THREADS_BIND" not in env:
        # One OMP core per rank; without it sglang asserts about NUMA nodes when tp/dp/pp > 1.
        ncpu = os.cpu_count() or 1
        env["SGLANG_CPU_OMP_THREADS_BIND"] = "|".join(str(i % ncpu) for i in range(parallel))
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.update(extra or {})
    return env


class SglangCpuServer:
    """A real sglang server process on the CPU; a context manager.

    ``SglangCpuServer(model_path, tp=2).start()`` returns once ``/health`` answers 200 (or, for a
    node that serves no HTTP, once the process is up: pass ``wait_healthy=False``).
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        tp: int = 1,
        dp: int = 1,
        pp: int = 1,
        port: int | None = None,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        log_path: str | os.PathLike | None = None,
        nnodes: int = 1,
        node_rank: int = 0,
        dist_init_addr: str | None = None,
        bind_mounts: Mapping[str, str] | None = None,
        max_total_tokens: int = 4096,
        startup_timeout_s: float = 300.0,
        api_key: str | None = None,
        admin_api_key: str | None = None,
        entrypoint: str = "launch_server",
        python: str | os.PathLike | None = None,
    ) -> None:
        self.model_path = str(model_path)
        self.python = server_python(python)
        self.tp = tp
        self.dp = dp
        self.pp = pp
        self.port = port or find_free_port()
        self.extra_args = list(extra_args)
        self.nnodes = nnodes
        self.node_rank = node_rank
        self.dist_init_addr = dist_init_addr
        self.bind_mounts = dict(bind_mounts or {})
        self.max_total_tokens = max_total_tokens
        self.startup_timeout_s = startup_timeout_s
        self.api_key = api_key
        self.admin_api_key = admin_api_key
        if entrypoint not in ("launch_server", "serve"):
            raise ValueError(f"entrypoint must be 'launch_server' or 'serve', got {entrypoint!r}")
        self.entrypoint = entrypoint
        if log_path is None:
            fd, log_path = tempfile.mkstemp(prefix=f"sglang-cpu-{self.port}-", suffix=".log")
            os.close(fd)
        self.log_path = Path(log_path)
        per_node_ranks = max(1, tp * dp * pp // max(1, nnodes))
        self.env = cpu_server_env(parallel=per_node_ranks, extra=env)
        self.proc: subprocess.Popen | None = None
        self._log_file = None

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def command(self) -> list[str]:
        """The full command line (including the mount-namespace wrapper, if any)."""
        if self.entrypoint == "serve":  # the `sglang serve` console script
            launcher = [self.python, "-c", "import sys; from sglang.cli.main import main; sys.exit(main())", "serve"]
        else:
            launcher = [self.python, "-m", "sglang.launch_server"]
        cmd = launcher + [
            "--model-path", self.model_path,
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--cuda-graph-backend-decode", "disabled",
            "--cuda-graph-backend-prefill", "disabled",
            "--max-total-tokens", str(self.max_total_tokens),
            "--host", LOOPBACK,
            "--port", str(self.port),
            "--tp-size", str(self.tp),
            "--dp-size", str(self.dp),
        ]  # fmt: skip
        if self.pp > 1:
            cmd += ["--pp-size", str(self.pp)]
        if self.nnodes > 1:
            if not self.dist_init_addr:
                raise ValueError("nnodes > 1 needs dist_init_addr ('127.0.0.1:PORT')")
            cmd += [
                "--nnodes", str(self.nnodes),
                "--node-rank", str(self.node_rank),
                "--dist-init-addr", self.dist_init_addr,
            ]  # fmt: skip
        if self.api_key:
            cmd += ["--api-key", self.api_key]
        if self.admin_api_key:
            cmd += ["--admin-api-key", self.admin_api_key]
        cmd += self.extra_args
        if self.bind_mounts:
            mounts = " && ".join(
                f"mount --bind {shlex.quote(src)} {shlex.quote(dst)}"
                for dst, src in self.bind_mounts.items()
            )
            # --propagation private keeps our binds out of the parent namespace.
            cmd = ["unshare", "-m", "--propagation", "private", "sh", "-c",
                   f'{mounts} && exec "$@"', "sglang-node"] + cmd  # fmt: skip
        return cmd

    def start(self, wait_healthy: bool = True) -> "SglangCpuServer":
        if self.proc is not None:
            raise RuntimeError("server already started")
        self._log_file = open(self.log_path, "ab", buffering=0)
        self._log_file.write(f"$ {shlex.join(self.command())}\n".encode())
        self.proc = subprocess.Popen(
            self.command(),
            stdout=self._log_file,
            stderr=subprocess.STDOUT,
            env=self.env,
            cwd=str(REPO_ROOT),
            start_new_session=True,  # its own process group: stop() can reap every child
        )
        if wait_healthy:
            self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (timeout_s or self.startup_timeout_s)
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise ServerStartError(
                    f"sglang exited with code {self.proc.returncode} while starting; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if requests.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise ServerStartError(
            f"sglang did not answer /health within {timeout_s or self.startup_timeout_s:.0f}s; "
            f"log {self.log_path}:\n{self.log_tail()}"
        )

    def is_running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM the server (it shuts its children down), then SIGKILL its group if needed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # leftovers of the group we started
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def __enter__(self) -> "SglangCpuServer":
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- logs --------------------------------------------------------------------------------

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def log_tail(self, n_lines: int = 60) -> str:
        return "\n".join(self.log_text().splitlines()[-n_lines:])

    # -- HTTP --------------------------------------------------------------------------------

    def _headers(self, headers: Mapping[str, str] | None, api_key: str | None, admin: bool = True) -> dict:
        out = dict(headers or {})
        default = (self.admin_api_key or self.api_key) if admin else self.api_key
        key = api_key if api_key is not None else default
        if key and "Authorization" not in out:
            out["Authorization"] = f"Bearer {key}"
        return out

    def post(
        self,
        path: str,
        json: Any = None,
        *,
        headers: Mapping[str, str] | None = None,
        api_key: str | None = None,
        timeout: float = 300.0,
    ) -> requests.Response:
        """POST JSON to ``path`` with the admin key (else the API key) unless ``api_key`` says
        otherwise for this call ('' = no key)."""
        return requests.post(
            self.base_url + path,
            json=json,
            headers=self._headers(headers, api_key),
            timeout=timeout,
        )

    def get(self, path: str, *, api_key: str | None = None, timeout: float = 60.0):
        return requests.get(
            self.base_url + path, headers=self._headers(None, api_key), timeout=timeout
        )

    def generate(self, prompt: str, max_new_tokens: int = 8, **sampling: Any) -> dict:
        """Greedy ``/generate`` (temperature 0, EOS does not stop); the parsed JSON reply."""
        params = {"temperature": 0.0, "max_new_tokens": max_new_tokens, "ignore_eos": True}
        params.update(sampling)
        resp = requests.post(
            self.base_url + "/generate",
            json={"text": prompt, "sampling_params": params},
            headers=self._headers(None, None, admin=False),
            timeout=300,
        )
        resp.raise_for_status()
        return resp.json()

    def generate_ids(self, prompt: str, max_new_tokens: int = 8) -> list[int]:
        """Greedy output token ids of ``prompt``."""
        return list(self.generate(prompt, max_new_tokens)["output_ids"])


# -- the command line: `python -m testbed.sglang_cpu MODEL ...` (the README's quickstart) -------

USAGE_EXAMPLES = """\
examples:
  python -m testbed.sglang_cpu /tmp/ws/model --port 30000 --pull-weights-allowed-roots /tmp/ws
  python -m testbed.sglang_cpu /tmp/ws/model --tp 2 -- --log-level debug

Arguments it does not know go to sglang unchanged (the plugin's flags too:
--pull-weights-allowed-roots, --pull-weights-timeout-s, ...). It prints one line when the
server answers /health, and stops the server's whole process tree on Ctrl-C or SIGTERM.
"""


def build_parser():
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m testbed.sglang_cpu",
        description="Run a real sglang server on this machine's CPU (no GPU), on 127.0.0.1, with the "
                    "weightsync plugin (POST /pull_weights, /update_weights_from_pulled).",
        epilog=USAGE_EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("model", metavar="MODEL", help="HF checkpoint dir to serve (version 0 of a run)")
    p.add_argument("--port", type=int, default=30000, help="port on 127.0.0.1 (default: %(default)s; 0 picks a free one)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks, one CPU core each (default: %(default)s)")
    p.add_argument("--log", metavar="FILE", default=None,
                   help="where the server's output goes (default: a new file in the temp dir, named on start)")
    p.add_argument("--startup-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for /health before giving up (default: %(default)s)")
    p.add_argument("--bf16", action="store_true",
                   help="compute in the checkpoint's bf16 (default: fp32, whose greedy output matches transformers')")
    return p


def main(argv=None) -> int:
    args, sglang_args = build_parser().parse_known_args(argv)
    if sglang_args[:1] == ["--"]:
        sglang_args = sglang_args[1:]
    from testbed.tiny_qwen3 import SERVER_COMPUTE_ARGS

    extra = ([] if args.bf16 else list(SERVER_COMPUTE_ARGS)) + sglang_args
    server = SglangCpuServer(
        args.model, tp=args.tp, port=args.port or None, extra_args=extra, log_path=args.log,
        startup_timeout_s=args.startup_timeout,
    )

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    try:
        print(f"starting sglang on {server.base_url} (log: {server.log_path})", file=sys.stderr, flush=True)
        server.start()
        print(f"serving {args.model} at {server.base_url}", file=sys.stderr, flush=True)
        server.proc.wait()
        print(f"sglang exited with code {server.proc.returncode}; log {server.log_path}:\n{server.log_tail(20)}",
              file=sys.stderr)
        return 1
    except ServerStartError as e:
        print(e, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        server.stop()


if __name__ == "__main__":
    sys.exit(main())
