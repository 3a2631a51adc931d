"""torch.compile for the native decode step, with an on-disk cache.

The one-token block step is compiled once (all blocks share the graph: their
weights are graph inputs) with a dynamic position, so one graph serves every
context length. Inductor's FX-graph and AOTAutograd caches live under
`~/.cache/edge-runtime/inductor` (or $EDGE_RUNTIME_CACHE), so a warm start
only re-traces one block instead of recompiling. A cold compile prints
progress on stderr.
"""
from __future__ import annotations

import os
import sys
import time



def cache_root() -> str:
    root = os.environ.get("EDGE_RUNTIME_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "edge-runtime")
    os.makedirs(root, exist_ok=True)
    return root


def configure_inductor_cache() -> str:
    path = os.path.join(cache_root(), "inductor")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", path)
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]


class CompileCache:
    def __init__(self, backend):
        self.backend = backend

    def warm_up(self, progress=None) -> float:
        """Compile (or load from cache) the decode step; returns seconds spent."""
        configure_inductor_cache()
        runner = self.backend.runner
        model = runner.model
        say = progress or (lambda msg: print(msg, file=sys.stderr, flush=True))
        t0 = time.perf_counter()
        model.enable_compile(dynamic=True, fullgraph=True)
        # A tiny prompt then two decode steps at different positions: the second proves the
        # position is symbolic (no recompile per position) and hits the same graph.
        done = {"flag": False}

        def ticker():
            import threading

            def run():
                waited = 0
                while not done["flag"]:
                    time.sleep(1)
                    waited += 1
                    if waited == 3:
                        say("[edge-runtime] compiling the decode step (first run only; cached afterwards)...")
                    elif waited > 3 and waited % 15 == 0:
                        say(f"[edge-runtime] still compiling... {waited} s")
            t = threading.Thread(target=run, daemon=True)
            t.start()
            return t

        ticker()
        try:
            runner.prefill([runner.bos_id or 0, 1])
            runner.step(2)
            runner.step(3)
        finally:
            done["flag"] = True
            runner.reset()
        spent = time.perf_counter() - t0
        if spent > 3:
            say(f"[edge-runtime] decode step compiled in {spent:.1f} s")
        return spent
