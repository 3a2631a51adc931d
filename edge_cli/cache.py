"""The response cache on the command line: the flags of `serve` and `chat`, and `edge-runtime cache`.

`edge-runtime cache stats|clear|export [--cache-path P]` reads or empties the cache file; `cache calibrate`
measures each embedder on the labelled set and writes edge_runtime/data/cache_calibration.json (the threshold
the cache uses, and the embedder it picks by default).

The file: --cache-path, else $EDGE_RUNTIME_RESPONSE_CACHE ("off" turns the default off), else
responses.sqlite3 under the cache folder (~/.cache/edge-runtime or $EDGE_RUNTIME_CACHE).
"""
from __future__ import annotations

import json
import os
import sys

from edge_runtime.errors import EdgeRuntimeError

ENV = "EDGE_RUNTIME_RESPONSE_CACHE"
EMBEDDER_CHOICES = ("auto", "wordllama", "hidden", "none")


def default_path() -> str | None:
    env = os.environ.get(ENV, "").strip()
    if env.lower() == "off":
        return None
    if env:
        return env
    from kernels.compile_cache import cache_root

    return os.path.join(cache_root(), "responses.sqlite3")


def add_cache_args(p) -> None:
    p.add_argument("--no-cache", action="store_true", help="answer every request anew: no response cache")
    p.add_argument("--cache-path", default=None, help=f"the response cache's SQLite file (default: ${ENV}, else "
                   "responses.sqlite3 in the cache folder)")
    p.add_argument("--cache-embedder", default="auto", choices=EMBEDDER_CHOICES,
                   help="semantic hits: auto = the one the labelled set picked; none = exact hits only")
    p.add_argument("--cache-sampled", action="store_true",
                   help="also cache and serve sampled (temperature > 0) requests; by default only greedy ones")
    p.add_argument("--cache-ttl", type=float, default=7 * 86400, help="seconds an entry lives (default 7 days)")
    p.add_argument("--cache-max-entries", type=int, default=10000, help="entries kept (least recently used go)")
    p.add_argument("--cache-audit", type=float, default=0.0,
                   help="share of hits regenerated in the background to count disagreements (/metrics)")


def model_fingerprint(local, cloud, args) -> str:
    """What answers: the local backend and its model file's bytes, the cloud worker, the route settings."""
    from edge_runtime.onnx.export import source_fingerprint

    path = getattr(local, "path", None)
    parts = [getattr(local, "name", type(local).__name__),
             source_fingerprint(path) if path and os.path.isfile(path) else str(path)]
    if cloud is not None:
        parts.append(f"cloud={getattr(args, 'cloud', '')}")
    parts += [f"route={getattr(args, 'route', 'auto')}", f"offline={bool(getattr(args, 'offline', False))}"]
    return "|".join(parts)


def make_cache(args, local, cloud):
    """The ResponseCache the flags ask for, or None (--no-cache, no cache flags on this command, or off)."""
    if not hasattr(args, "no_cache") or args.no_cache:
        return None
    path = args.cache_path or default_path()
    if path is None:
        return None
    if not args.cache_ttl > 0 or args.cache_max_entries < 1 or not 0 <= args.cache_audit <= 1:
        raise EdgeRuntimeError("--cache-ttl and --cache-max-entries must be positive and --cache-audit in [0, 1]")
    from edge_runtime.cache import ResponseCache
    from edge_runtime.cache.calibration import default_embedder
    from edge_runtime.cache.embedders import EMBEDDERS

    name = default_embedder() if args.cache_embedder == "auto" else args.cache_embedder
    if name == "hidden":
        embedder = EMBEDDERS[name](getattr(args, "model", "default"))
    else:
        embedder = None if name == "none" else EMBEDDERS[name]()
    return ResponseCache(path, model_fingerprint(local, cloud, args), embedder, sampled=args.cache_sampled,
                         audit_share=args.cache_audit, ttl_s=args.cache_ttl, max_entries=args.cache_max_entries)


def register(sub) -> None:
    c = sub.add_parser("cache", help="the response cache: stats, clear, export, calibrate")
    c.add_argument("action", choices=["stats", "clear", "export", "calibrate"])
    c.add_argument("--cache-path", default=None, help="the cache file (default as for serve)")
    c.add_argument("--embedders", default="wordllama,hidden", help="calibrate: the embedders to measure")
    c.add_argument("--write", action="store_true", help="calibrate: write edge_runtime/data/cache_calibration.json")
    c.set_defaults(func=cmd_cache)


def cmd_cache(args) -> int:
    if args.action == "calibrate":
        return _calibrate(args)
    import sqlite3

    from edge_runtime.cache.store import CacheStore

    path = args.cache_path or default_path()
    if path is None:
        raise EdgeRuntimeError(f"no cache file: ${ENV} is off and no --cache-path was given")
    if args.action != "clear" and not os.path.exists(path):
        raise EdgeRuntimeError(f"no cache file at {path}")
    try:
        store = CacheStore(path)
        if args.action == "stats":
            print(json.dumps(store.stats(), indent=2))
        elif args.action == "clear":
            print(f"removed {store.clear()} entries from {path}")
        else:
            for entry in store.export():
                print(json.dumps(entry, ensure_ascii=False))
    except sqlite3.Error as e:
        raise EdgeRuntimeError(f"the cache file {path} is unreadable ({type(e).__name__}: {e})") from None
    return 0


def _calibrate(args) -> int:
    from edge_runtime.cache import calibration
    from edge_runtime.cache.embedders import EMBEDDERS

    names = [n.strip() for n in args.embedders.split(",") if n.strip()]
    unknown = [n for n in names if n not in EMBEDDERS]
    if unknown or not names:
        raise EdgeRuntimeError(f"unknown embedder(s) {', '.join(unknown) or '(none)'}; choose from "
                               f"{', '.join(EMBEDDERS)}")
    pairs = calibration.load_pairs()
    results = {}
    for name in names:
        res = calibration.calibrate(EMBEDDERS[name](), pairs)
        results[name] = res
        print(f"{name}: threshold {res['threshold']:.4f}, recall {res['recall']:.3f} with {res['false_hits']} false "
              f"hits of {sum(1 for p in pairs if p['label'] == 'miss')}; {res['cv']['folds']}-fold CV recall "
              f"{res['cv']['recall_mean']:.3f}, false-hit rate {res['cv']['false_hit_rate_mean']:.4f}", flush=True)
    chosen = max(results, key=lambda n: (results[n]["cv"]["recall_mean"], -results[n]["cv"]["false_hit_rate_mean"]))
    out = {"pairs": len(pairs), "set_sha256": calibration.set_digest(), "false_hit_budget": calibration.FALSE_HIT_BUDGET,
           "chosen": chosen, "embedders": results}
    if args.write:
        with open(calibration.CALIBRATION, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
            f.write("\n")
        print(f"wrote {calibration.CALIBRATION} (chosen: {chosen})", file=sys.stderr)
    else:
        print(json.dumps({"chosen": chosen}))
    return 0
