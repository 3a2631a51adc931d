"""A real `edge-runtime serve` process on a free loopback port: what `bench serve` and the gateway tests drive."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading


class ServeProcess:
    def __init__(self, *args: str, key: str | None = None, threads: int | None = 2, cwd: str | None = None,
                 cache: str | None = None):
        """`cache`: the response cache's file; None: --no-cache (benchmarks measure generation, cold)."""
        cmd = [sys.executable, "-m", "edge_cli", "serve", "--port", "0",
               *(["--threads", str(threads)] if threads else []), *args, *(["--api-key", key] if key else []),
               *(["--cache-path", cache] if cache else ["--no-cache"])]
        self.proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()  # "edge-runtime gateway listening on http://HOST:PORT (...)"
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"serve did not start: {line} {''.join(self.err)[-2000:]}")
        self.url, self.banner = m.group(1), line

    def stop(self, timeout: float = 15) -> None:
        stop_group(self.proc, timeout)


def stop_group(proc: subprocess.Popen, timeout: float) -> None:
    """SIGTERM a process group started with start_new_session, SIGKILL it after `timeout` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
