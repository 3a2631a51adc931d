"""A real `edge-runtime serve` process on a free loopback port, for the gateway tests."""
import os

from edge_cli.serve_process import ServeProcess, stop_group

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KEY = "sk-test-123"
__all__ = ["KEY", "ROOT", "Gateway", "stop_group"]


class Gateway(ServeProcess):
    def __init__(self, *args, key=KEY):
        super().__init__(*args, key=key, threads=2, cwd=ROOT)
