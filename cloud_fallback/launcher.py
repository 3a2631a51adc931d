"""Start `edge-runtime worker` as a child process on a free loopback port (benchmarks, tests, demos)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import urllib.request

from edge_runtime.errors import EdgeRuntimeError


class WorkerProcess:
    """`edge-runtime worker --port 0 --token-file F *args` in its own process group.

    `url` (ws:// or wss://), `http_url` and `token` are set once it listens;
    `stop()` ends it with SIGTERM (SIGKILL after `grace` seconds), `kill()` at once."""

    def __init__(self, *args: str, token: str | None = None, threads: int | None = 2, start_timeout: float = 180.0,
                 cwd: str | None = None):
        self.token = token or "w-" + os.urandom(12).hex()
        fd, self.token_file = tempfile.mkstemp(prefix="worker-token-")
        with os.fdopen(fd, "w") as f:
            f.write(self.token + "\n")
        cmd = [sys.executable, "-m", "cloud_fallback", "--port", "0", "--token-file", self.token_file]
        if threads:
            cmd += ["--threads", str(threads)]
        self.proc = subprocess.Popen([*cmd, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                     text=True, start_new_session=True)
        self.stderr: list[str] = []
        threading.Thread(target=lambda: self.stderr.extend(self.proc.stderr), daemon=True).start()
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self.proc.stdout.readline()), daemon=True)
        reader.start()
        reader.join(start_timeout)
        m = re.search(r"listening on (wss?)://([\d.]+):(\d+)", line[0] if line else "")
        if not m:
            self.stop()
            raise EdgeRuntimeError(f"the worker did not start: {(line or [''])[0].strip()} "
                                   f"{''.join(self.stderr)[-3000:]}")
        scheme, host, self.port = m.group(1), m.group(2), int(m.group(3))
        self.url = f"{scheme}://{host}:{self.port}"
        self.http_url = f"{'https' if scheme == 'wss' else 'http'}://{host}:{self.port}"

    def get(self, path: str, context=None) -> tuple[int, str]:
        with urllib.request.urlopen(self.http_url + path, timeout=10, context=context) as r:
            return r.status, r.read().decode()

    def metrics(self) -> dict[str, float]:
        """GET /metrics parsed: {'name{labels}': value}."""
        out = {}
        for line in self.get("/metrics")[1].splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def kill(self) -> None:
        """SIGKILL the whole process group (failover tests)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()

    def stop(self, grace: float = 20.0) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(grace)
            except subprocess.TimeoutExpired:
                self.kill()
        if os.path.exists(self.token_file):
            os.unlink(self.token_file)
