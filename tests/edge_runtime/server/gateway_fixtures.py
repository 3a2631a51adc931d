"""A real `edge-runtime serve` process on a free loopback port, for the gateway tests."""
import os
import re
import signal
import subprocess
import sys
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KEY = "sk-test-123"


class Gateway:
    def __init__(self, *args, key=KEY):
        cmd = [sys.executable, "-m", "edge_runtime", "serve", "--port", "0", "--threads", "2", *args]
        if key:
            cmd += ["--api-key", key]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.err: list[str] = []
        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True).start()
        line = self.proc.stdout.readline()
        m = re.search(r"listening on (http://[\d.]+:\d+)", line)
        if not m:
            self.stop()
            raise RuntimeError(f"serve did not start: {line} {''.join(self.err)[-2000:]}")
        self.url = m.group(1)

    def stop(self):
        stop_group(self.proc, 15)


def stop_group(proc, timeout: float) -> None:
    """SIGTERM a process group started with start_new_session, SIGKILL it after `timeout` seconds."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
