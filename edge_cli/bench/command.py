"""`edge-runtime bench NAME`: the benchmarks, each against its anchor in one run (decode, kv, attention,
batching, hybrid, spec, serve, cache) and the report over their JSON. Only wiring: each benchmark lives in its own
module and is imported when asked for."""
from __future__ import annotations


def register(sub) -> None:
    b = sub.add_parser("bench", help="benchmarks (each against its anchor, in one run)")
    b.add_argument("name", choices=["decode", "kv", "attention", "batching", "hybrid", "spec", "serve", "cache", "report"])
    b.add_argument("--dir", default="bench-results", help="report: directory of benchmark JSON files")
    b.add_argument("--out", default=None, help="report: output directory (default DIR/report)")
    b.add_argument("--model", default="default")
    b.add_argument("--threads", type=int, default=None)
    b.add_argument("--repeats", type=int, default=3)
    b.add_argument("--json", dest="json_file", default=None, help="write results to this JSON file")
    b.add_argument("--backends", default=None, help="decode: comma-separated backends side by side "
                   "(native, llama.cpp, onnxruntime; default native,llama.cpp)")
    bb = b.add_argument_group("batching")
    bb.add_argument("--requests", type=int, default=100, help="batching: requests in the workload")
    bb.add_argument("--max-batch", type=int, default=8, help="batching: the worker's max batch")
    bb.add_argument("--quant", default="auto", help="batching: the worker's weights (auto = GGUF int4 kernels, "
                    "bf16/fp32 = the same weights dequantized)")
    bb.add_argument("--schedules", default="continuous,static,sequential", help="batching: which schedules to run")
    bb.add_argument("--skip-sequential", action="store_true", help="batching: skip the one-at-a-time schedule")
    bb.add_argument("--peer", default=None, help="batching: an OpenAI-compatible server at max batch 8 "
                    "(e.g. vLLM, http://127.0.0.1:8001/v1), measured side by side")
    bb.add_argument("--peer-default", default=None, help="batching: the same server at its default batch; "
                    "compared with our worker at --default-batch")
    bb.add_argument("--default-batch", type=int, default=256, help="batching: our max batch against --peer-default")
    bb.add_argument("--draft", default=None, choices=["ngram", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-ngram",
                                                      "mtp-attn-tree", "mtp-attn-ngram-tree"],
                    help="batching: instead, the worker with this "
                    "--draft against without, on the workload and on 12 input-grounded prompts one at a time")
    bh = b.add_argument_group("hybrid")
    bh.add_argument("--prompts", type=int, default=12, help="hybrid: prompts of the labelled set for TTFT and hand-offs")
    bh.add_argument("--failovers", type=int, default=5, help="hybrid: worker kills for the failover gap")
    bh.add_argument("--routing-prompts", type=int, default=0, help="hybrid: labelled prompts for the routing "
                    "figures (0 = all)")
    bs = b.add_argument_group("spec")
    bs.add_argument("--draft-k", type=int, default=3, help="spec: draft tokens per verification (MT-Bench runs)")
    bs.add_argument("--tree-size", type=int, default=15, help="spec: drafts per tree in the fixed-size tree runs")
    bs.add_argument("--questions", type=int, default=80, help="spec: MT-Bench first turns to run (of 80)")
    bs.add_argument("--grounded", type=int, default=12, help="spec: input-grounded prompts to run")
    bs.add_argument("--spec-tokens", type=int, default=128, help="spec: tokens per answer")
    bv = b.add_argument_group("serve")
    bv.add_argument("--serve-requests", type=int, default=8, help="serve: requests sent one at a time, then at once")
    bv.add_argument("--serve-tokens", type=int, default=128, help="serve: tokens per answer")
    b.add_argument("--cache-pairs", type=int, default=40, help="cache: pairs of the labelled set to replay")
    b.set_defaults(func=cmd_bench)
    b.set_defaults(_flag_defaults={a.dest: (a.default, a.option_strings[0]) for a in b._actions if a.option_strings})
    groups = {"batching": bb, "hybrid": bh, "spec": bs, "serve": bv}
    b.set_defaults(_flag_owner={a.dest: name for name, g in groups.items() for a in g._group_actions}
                   | {"cache_pairs": "cache", "dir": "report", "out": "report"})


def _refuse_foreign_flags(args) -> None:
    """A flag of another benchmark is refused, never silently ignored."""
    for dest, owner in args._flag_owner.items():
        default, flag = args._flag_defaults[dest]
        if owner != args.name and getattr(args, dest) != default:
            raise SystemExit(f"edge-runtime bench {args.name}: {flag} applies to `bench {owner}` only")


def cmd_bench(args) -> int:
    _refuse_foreign_flags(args)
    if args.name == "report":
        from edge_cli.bench.report import run_report

        return run_report(args)
    if args.name == "kv":
        from edge_cli.bench.kv import run_kv_bench

        return run_kv_bench(args)
    if args.name == "attention":
        from edge_cli.bench.attention import run_attention_bench

        run_attention_bench(args.json_file, threads=args.threads)
        return 0
    if args.name == "batching":
        from edge_cli.bench.batching import run_batching_bench

        return run_batching_bench(args)
    if args.name == "spec":
        from edge_cli.bench.spec import run_spec_bench

        return run_spec_bench(args)
    if args.name == "serve":
        from edge_cli.bench.serve import run_serve_bench

        return run_serve_bench(args)
    if args.name == "cache":
        from edge_cli.bench.cache import run_cache_bench

        return run_cache_bench(args)
    if args.name == "hybrid":
        from edge_cli.bench.hybrid import run_hybrid_bench

        return run_hybrid_bench(args)
    from edge_cli.bench.decode import run_bench

    return run_bench(args)
