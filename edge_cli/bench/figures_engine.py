"""What the engine benchmarks' files mean: decode, perplexity, kv, attention and spec, one plot and rows each.

Each builder takes the parsed JSON of one `edge-runtime bench decode|kv|attention|spec --json FILE` (for
perplexity: every `edge-runtime perplexity --json` file of a directory, keyed by file name, compared with each
other) and returns (title, caption, rows, figure). Which builder a file goes to is `figures.recognise`; the
report page is `report`. This module reads no directory and writes no file.
"""
from __future__ import annotations

from edge_cli.bench.figure_kit import (OURS, OURS2, PEER, TARGET, Row, _bars, _div, _fig, _get, _grouped, _hline,
                                       _isnum, _num, _pct, _row, _stored, _target)

DECODE_BACKENDS = [("native", "native", OURS), ("native_exact", "native\nexact", OURS2),
                   ("llama_cpp", "llama.cpp", PEER)]


def _decode(d):
    n, l, w = d["native"], d["llama_cpp"], d.get("workload") or {}
    backends = [(k, label, c) for k, label, c in DECODE_BACKENDS if isinstance(d.get(k), dict)]
    fig, axs = _fig(5, f"native vs llama.cpp: model {d.get('model', '?')}, {d.get('threads', '?')} threads, "
                       f"ISA variant {d.get('isa') or n.get('isa') or '?'}")
    specs = [("prefill_tok_s", "prefill_runs", f"prefill, {w.get('prefill_prompt_tokens', '?')}-token prompt", "tok/s"),
             ("decode_tok_s", "decode_runs", f"decode, {w.get('decode_tokens', '?')} tokens", "tok/s"),
             ("warm_start_to_first_token_s", None, "warm start to first token", "s"),
             ("peak_rss_mib", None, "peak RSS", "MiB")]
    for ax, (key, runs, title, unit) in zip(axs, specs):
        _bars(ax, [b for _, b, _ in backends], [d[k].get(key) for k, _, _ in backends], title, unit,
              [c for _, _, c in backends], runs and [d[k].get(runs) for k, _, _ in backends])
    rows = []
    for ax, key, what in ((axs[0], "prefill_ratio", "prefill_tok_s"), (axs[1], "decode_ratio", "decode_tok_s")):
        t = _target(d, key)
        _hline(ax, _isnum(l.get(what)) and t and l[what] * t, f"target: native >= {_num(t)} x llama.cpp", 0)
        rows.append(_row(f"{what.split('_')[0]} tok/s", _num(n.get(what)), f"llama.cpp {_num(l.get(what))}",
                         _stored(d, key, n.get(what), l.get(what)), key, t))
        if isinstance(d.get("native_exact"), dict):
            x = d["native_exact"].get(what)
            rows.append(_row(f"{what.split('_')[0]} tok/s, --arith exact", _num(x), f"llama.cpp {_num(l.get(what))}",
                             _div(x, l.get(what)), "native exact / llama.cpp"))
    warm = _target(d, "warm_start_to_first_token_s")
    _hline(axs[2], warm, f"target <= {_num(warm)} s")
    ws, rss = "warm_start_to_first_token_s", "peak_rss_mib"
    rows += [_row("warm start to first token", _num(n.get(ws), "s"), f"llama.cpp {_num(l.get(ws), 's')}",
                  _div(n.get(ws), l.get(ws)), "native / llama.cpp", warm, "<=", n.get(ws), "s (native)"),
             _row("peak RSS", _num(n.get(rss), "MiB"), f"llama.cpp {_num(l.get(rss), 'MiB')}",
                  _div(n.get(rss), l.get(rss)), "native / llama.cpp")]
    rows += _decode_steps(d, n, axs[4])
    cap = (f"Each backend in its own process, same GGUF; medians of {w.get('repeats', '?')} runs (dots: each run); "
           f"decode after a {w.get('decode_prompt_tokens', '?')}-token prompt. Ratios: native / llama.cpp. "
           f"Step costs: the native int8 C step for M sequences at a {n.get('context', '?')}-token context.")
    return "decode: native vs llama.cpp", cap, rows, fig


def _decode_steps(d, n, ax):
    """The batched step's cost curve t(M)/t(1), the verification of 4 rows and the bandwidth share (native)."""
    ms, ratio = n.get("step_ms") or {}, d.get("step_cost_ratio") or n.get("step_cost_ratio") or {}
    ms_keys = sorted(ratio, key=int)
    ax.plot([int(m) for m in ms_keys], [ratio[m] for m in ms_keys], "o-", color=OURS, label="native int8")
    ax.plot([int(m) for m in ms_keys], [int(m) for m in ms_keys], ":", color="#555555", label="M lone steps")
    for m in ms_keys:
        ax.annotate(_num(ratio[m]), (int(m), ratio[m]), xytext=(4, -10), textcoords="offset points", fontsize=8)
    pts = [(int(m), _target(d, f"step_cost_ratio.{m}")) for m in ms_keys if _target(d, f"step_cost_ratio.{m}")]
    ax.plot([m for m, _ in pts], [t for _, t in pts], "v", color=TARGET, ms=8, label="target (<=)")
    v = _get(d, "verify_cost_ratio_4") if _isnum(_get(d, "verify_cost_ratio_4")) else n.get("verify_cost_ratio_4")
    if _isnum(v):
        ax.plot([4], [v], "s", color=PEER, label="verify 4 rows")
    ax.set_xscale("log", base=2)
    ax.set_xticks([int(m) for m in ms_keys], ms_keys)
    ax.set_title(f"batched step cost t(M)/t(1), t(1) = {_num(ms.get('1'), 'ms')}", fontsize=10)
    ax.set_xlabel("sequences M")
    ax.grid(alpha=0.3)
    rows = [_row(f"batched step, M = {m}", _num(ms.get(m), "ms"), f"t(1) {_num(ms.get('1'), 'ms')}", ratio[m],
                 f"step_cost_ratio {m}", _target(d, f"step_cost_ratio.{m}"), "<=") for m in ms_keys if m != "1"]
    if _isnum(v):
        rows.append(_row("verification of 4 rows", _num(n.get("verify_ms_4"), "ms"),
                         f"one row {_num(n.get('verify_ms_1'), 'ms')}", v, "verify_cost_ratio_4",
                         _target(d, "verify_cost_ratio_4"), "<="))
    if _isnum(d.get("bandwidth_share")):
        rows.append(Row("decode's share of its bandwidth limit", _pct(d["bandwidth_share"]),
                        f"limit {_num(d.get('bandwidth_limit_tok_s'))} tok/s at {_num(d.get('bandwidth_gbs'))} GB/s "
                        f"read bandwidth", f"{_num(d['bandwidth_share'])} (bandwidth_share)"))
    return rows


def _kv(d):
    per, c, p = d["kv_bytes_per_token"], d.get("capacity") or {}, d.get("prefix") or {}
    fig, axs = _fig(3, f"paged KV cache: model {d.get('model', '?')}")
    dtypes = list(per)
    _bars(axs[0], dtypes, [per[k] / 1024 if _isnum(per[k]) else None for k in dtypes],
          "KV bytes per token (all layers)", "KiB / token", [PEER if k == "int8" else OURS for k in dtypes])
    t_int8 = _target(d, "int8_over_fp16")
    fp16 = per.get("fp16")
    _hline(axs[0], _isnum(fp16) and fp16 * t_int8 / 1024, f"target: int8 <= {_num(t_int8)} x fp16",
           dtypes.index("int8") if "int8" in dtypes else None)
    _bars(axs[1], ["paged", "contiguous"], [c.get("paged_seqs"), c.get("contiguous_seqs")],
          f"{_num(c.get('seq_tokens'))}-token sequences in {_num(c.get('budget_mib'))} MiB", "sequences", [OURS, PEER])
    t_cap = _target(d, "capacity_ratio")
    _hline(axs[1], _isnum(c.get("contiguous_seqs")) and c["contiguous_seqs"] * t_cap,
           f"target: paged >= {_num(t_cap)} x contiguous", 0)
    _bars(axs[2], ["cached prefix", "cold"], [p.get("cached_ttft_ms"), p.get("cold_ttft_ms")],
          f"TTFT, {_num(p.get('prompt_tokens'))}-token prompt", "ms", [OURS, PEER],
          [p.get("cached_runs_ms"), p.get("cold_runs_ms")])
    t_pre = _target(d, "prefix_ttft_speedup")
    _hline(axs[2], _isnum(p.get("cold_ttft_ms")) and p["cold_ttft_ms"] / t_pre, f"target: cold / {_num(t_pre)}", 0)
    rows = [_row(f"KV bytes / token, {k}", _num(per[k]), f"fp16 {_num(fp16)}", _div(per[k], fp16),
                 "int8_over_fp16" if k == "int8" else f"{k} / fp16", t_int8 if k == "int8" else None, "<=")
            for k in dtypes if k != "fp16"]
    bs, waste = d.get("block_size"), d.get("waste_slots_per_seq")
    rows += [_row("concurrent sequences, paged", _num(c.get("paged_seqs")),
                  f"contiguous {_num(c.get('contiguous_seqs'))} ({_num(c.get('contiguous_tokens_per_seq'))} tokens each)",
                  _stored(d, "capacity_ratio", c.get("paged_seqs"), c.get("contiguous_seqs")), "capacity_ratio", t_cap),
             _row("unused slots per live sequence", _num(waste), f"block size {_num(bs)}", _div(waste, bs),
                  "waste / block size", _target(d, "waste_slots_per_seq"), "<", waste, "slots"),
             _row("TTFT with the prefix cached", _num(p.get("cached_ttft_ms"), "ms"),
                  f"cold {_num(p.get('cold_ttft_ms'), 'ms')}",
                  _stored(d, "prefix_ttft_speedup", p.get("cold_ttft_ms"), p.get("cached_ttft_ms")),
                  "prefix_ttft_speedup", t_pre)]
    cap = (f"int8 includes its fp32 scales; capacity: paged blocks vs a contiguous preallocation of the full context; "
           f"prefix: KV {p.get('kv_dtype', '?')}, medians (dots: each run).")
    return "kv: paged KV cache", cap, rows, fig


def _attention(d):
    res = {int(k): v for k, v in d["results"].items()}
    ns, kernels = sorted(res), ["tiled", "naive", "sdpa"]
    fig, axs = _fig(3, "attention kernels: tiled (ours) vs naive vs torch SDPA")
    style = {"tiled": (OURS, "o", "tiled (ours)"), "naive": (PEER, "s", "naive"), "sdpa": ("#555555", "^", "torch SDPA")}
    for ax, key, title, unit in ((axs[0], "ms", "causal prefill time", "ms"), (axs[1], "peak_mib", "peak extra memory", "MiB")):
        for k in kernels:
            pts = [(n, res[n][k][key]) for n in ns if _isnum((res[n].get(k) or {}).get(key))]
            ax.plot([a for a, _ in pts], [b for _, b in pts], marker=style[k][1], color=style[k][0], label=style[k][2])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xticks(ns, [f"{n:,}" for n in ns])
        ax.set_xlabel("sequence length N")
        ax.set_ylabel(f"{unit} (log)")
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3, which="both")
    dec = d.get("decode") or {}
    _grouped(axs[2], list(dec), {"paged decode": [v.get("paged_decode_us") for v in dec.values()],
                                 "gather + SDPA": [v.get("gather_then_sdpa_us") for v in dec.values()]},
             "decode attention, 1 token, by KV dtype", "µs", [OURS, PEER])
    t_mem, t_speed, rows = _target(d, "mem_ratio_naive_over_tiled_16k"), _target(d, "speed_ratio_tiled_over_sdpa_16k"), []
    for n in ns:
        r = {k: res[n].get(k) or {} for k in kernels}
        tm, big = (r["tiled"].get("ms"), r["tiled"].get("peak_mib")), n == 16384
        rows += [_row(f"N={n:,}: time, tiled", _num(tm[0], "ms"), f"naive {_num(r['naive'].get('ms'), 'ms')}",
                      _div(r["naive"].get("ms"), tm[0]), "naive / tiled"),
                 _row(f"N={n:,}: time, tiled", _num(tm[0], "ms"), f"SDPA {_num(r['sdpa'].get('ms'), 'ms')}",
                      _stored(d, "speed_ratio_tiled_over_sdpa_16k", r["sdpa"].get("ms"), tm[0]) if big
                      else _div(r["sdpa"].get("ms"), tm[0]), "speed_ratio_tiled_over_sdpa_16k" if big else "SDPA / tiled",
                      t_speed if big else None),
                 _row(f"N={n:,}: peak memory, tiled", _num(tm[1], "MiB"), f"naive {_num(r['naive'].get('peak_mib'), 'MiB')}",
                      _stored(d, "mem_ratio_naive_over_tiled_16k", r["naive"].get("peak_mib"), tm[1]) if big
                      else _div(r["naive"].get("peak_mib"), tm[1]), "mem_ratio_naive_over_tiled_16k" if big
                      else "naive / tiled", t_mem if big else None)]
    rows += [_row(f"decode attention, {k} KV", _num(v.get("paged_decode_us"), "µs"),
                  f"gather + SDPA {_num(v.get('gather_then_sdpa_us'), 'µs')}",
                  _stored(v, "paged_decode_speedup", v.get("gather_then_sdpa_us"), v.get("paged_decode_us")),
                  "paged_decode_speedup") for k, v in dec.items()]
    w = d.get("workload") or {}
    per_head = [f"{n:,}" for n in ns if (res[n].get("naive") or {}).get("mode") == "per_head"]
    cap = (f"{w.get('num_heads', '?')} query / {w.get('num_kv_heads', '?')} KV heads, head_dim {w.get('head_dim', '?')}, "
           f"{w.get('dtype', '?')}, {d.get('threads', '?')} threads; peak memory is the extra RSS of one call."
           + (f" Naive ran head by head at N={', '.join(per_head)}." if per_head else ""))
    return "attention: kernels at each length", cap, rows, fig


SPEC_KEYS = [("mtp.speedup_over_plain", "MTP vs plain decode", "plain decode 1.0"),
             ("mtp.speedup_over_llama_cpp", "MTP vs llama.cpp", "llama.cpp 1.0"),
             ("mtp.tree.speedup_over_plain", "MTP trees vs plain decode", "plain decode 1.0"),
             ("mtp_attn.speedup_over_plain", "attention head vs plain decode", "plain decode 1.0"),
             ("auto.speedup_over_plain", "--draft auto vs plain (MT-Bench)", "plain decode 1.0"),
             ("auto.speedup_over_llama_cpp", "--draft auto vs llama.cpp (MT-Bench)", "llama.cpp 1.0"),
             ("auto.speedup_over_plain_grounded", "--draft auto vs plain (grounded prompts)", "plain decode 1.0"),
             ("ngram.speedup_over_plain_grounded", "n-gram vs plain (grounded prompts)", "plain decode 1.0")]


def _spec(d):
    keys = [(k, name, anchor) for k, name, anchor in SPEC_KEYS if _isnum(_get(d, k))]
    fig, axs = _fig(2, "speculative decoding", [3, 1])
    _bars(axs[0], [n.replace(" vs ", "\nvs ").replace(" (", "\n(") for _, n, _ in keys], [_get(d, k) for k, _, _ in keys], "speedup",
          "x anchor", OURS)
    axs[0].axhline(1.0, color="#555555", lw=1, label="anchor (1.0)")
    for i, (k, _, _) in enumerate(keys):
        _hline(axs[0], _target(d, k), "target" if i == 0 else None, i)
    accepted = [(k, n) for k, n in (("mtp.mean_accepted", "MTP chains"), ("mtp_ngram.mean_accepted", "MTP + lookup"),
                                    ("mtp.tree_mean_accepted", "MTP trees"),
                                    ("mtp_attn.mean_accepted", "attention head chains"),
                                    ("mtp_attn.tree_mean_accepted", "attention head trees"),
                                    ("mtp_attn_ngram.tree_mean_accepted", "attention head + lookup trees"))
                if _isnum(_get(d, k))]
    _bars(axs[1], [n for _, n in accepted], [_get(d, k) for k, _ in accepted], "tokens per verification\n(mean)",
          "tokens")
    rows = [_row(name, _num(_get(d, k)), anchor, _get(d, k), k, _target(d, k)) for k, name, anchor in keys]
    for k, name in accepted:
        rows.append(_row(f"{name}: tokens per verification", _num(_get(d, k)), "", None, "", _target(d, k), ">=",
                         _get(d, k)))
    return "spec: speculative decoding", "Speedups are tok/s over the anchor's tok/s.", rows, fig




def _perplexity(files: dict):
    """`files`: {file name: one `edge-runtime perplexity --json` result}, all compared with each other."""
    runs = sorted(files.items(), key=lambda kv: (kv[1].get("backend") != "native", kv[1].get("arith") != "int8", kv[0]))

    def config(r):
        return f"{r.get('backend', '?')}" + (f" --arith {r['arith']}" if r.get("arith") else "")
    counts = [config(r) for _, r in runs]

    def label(name, r):  # the file name where the configuration does not tell the run apart
        return config(r) if r.get("arith") and counts.count(config(r)) == 1 else f"{config(r)} ({name})"
    labels = [label(n, r) for n, r in runs]
    fig, axs = _fig(2, "perplexity: native vs llama.cpp on the same text")
    ppl = [r["ppl"] for _, r in runs]
    bars = axs[0].barh(range(len(runs)), ppl, 0.6, color=[PEER if r.get("backend") == "llama.cpp" else OURS
                                                           for _, r in runs])
    axs[0].bar_label(bars, labels=[f"{p:.4f}" for p in ppl], fontsize=8, padding=2)
    axs[0].set_yticks(range(len(runs)), [lab.replace(" (", "\n(") for lab in labels], fontsize=8)
    axs[0].set_xlim(min(ppl) * 0.97, max(ppl) * 1.02)
    axs[0].set_title("perplexity (lower is better; axis cut)", fontsize=10)
    rows, pairs = [], []
    for i, (na, a) in enumerate(runs):  # NOTE: natives against llama.cpp and against each other (int8 vs exact)
        for nb, b in runs[i + 1:]:
            same = a.get("backend") == b.get("backend") and a.get("arith") == b.get("arith")
            if same and (a.get("backend") == "llama.cpp" or a.get("arith") is not None):
                continue  # two runs of the same configuration
            if (a.get("tokens"), a.get("ctx")) != (b.get("tokens"), b.get("ctx")):
                continue  # different texts or windows: not comparable
            rel = a["ppl"] / b["ppl"] - 1
            pairs.append((f"{label(na, a)}\nvs {label(nb, b)}", 100 * rel))
            rows.append(Row(f"perplexity, {label(na, a)}", f"{a['ppl']:.4f}", f"{label(nb, b)} {b['ppl']:.4f}",
                            f"{100 * rel:+.2f} % (a / b - 1)", "within 1 %", abs(rel) <= 0.01))
    bars = axs[1].barh(range(len(pairs)), [v for _, v in pairs], 0.6, color=OURS2)
    axs[1].bar_label(bars, labels=[f"{v:+.2f} %" for _, v in pairs], fontsize=8, padding=2)
    axs[1].set_yticks(range(len(pairs)), [p for p, _ in pairs], fontsize=7)
    axs[1].axvline(0, color="#555555", lw=1)
    for x in (-1.0, 1.0):
        axs[1].axvline(x, color=TARGET, ls="--", lw=1.2, label="target: within 1 %" if x > 0 else None)
    axs[1].set_xlim(-1.6, 1.6)
    axs[1].set_title("difference a / b - 1", fontsize=10)
    axs[1].set_xlabel("%")
    for ax in axs:
        ax.invert_yaxis()
        ax.grid(axis="x", alpha=0.3)
    first = runs[0][1]
    cap = (f"{_num(first.get('tokens'))} scored tokens in {_num(first.get('windows'))} windows of "
           f"{_num(first.get('ctx'))} tokens; differences are perplexity a / b - 1 between runs on the same "
           "tokens. Runs without an `arith` key predate it: the file name tells them apart.")
    return "perplexity: fidelity against llama.cpp", cap, rows, fig


def _k3(h: dict):
    """Tokens per verification at k = 3: the replayed verification where the file has it (exact), else the
    estimate from chain accuracy that files before it recorded (over every position, higher)."""
    return h.get("mean_accepted_k3", h.get("expected_accepted_k3"))


def _tpv(x) -> str:
    """Tokens per verification as written: three decimals (2.005 is not 2)."""
    return f"{x:.3f}" if _isnum(x) else _num(x)


def _how(h: dict) -> str:
    return "replayed" if "mean_accepted_k3" in h else "estimated from chain accuracy"


def _mtp_heads(d):
    """`train-mtp --arch attention --json`: draft heads measured offline on the model's MT-Bench answers."""
    mlp, att = d["mlp_shipped"], d["attention"]
    target = _target(d, "mean_accepted_k3")
    recipe = (f"taps {','.join(map(str, att['taps']))}, " if att.get("taps") else "") + f"{att.get('loss', 'hard')} loss, "
    recipe += (f"windows of {att['window']} starts" if att.get("window") else f"{att.get('batch', '?')} whole answers a step")
    fig, axs = _fig(2, f"draft heads offline on {d.get('mt_bench_answers', '?')} MT-Bench answers "
                       f"({_num(d.get('mt_bench_answer_tokens'))} tokens)", [1, 2])
    _bars(axs[0], ["MLP heads\n(shipped)", "attention\nhead"], [_k3(mlp), _k3(att)],
          "tokens per verification, k = 3", "tokens", [PEER, OURS])
    _hline(axs[0], target, f"target >= {_num(target)}")
    curve = sorted(d.get("curve") or [], key=lambda c: c["train_answer_tokens"])
    if curve:
        axs[1].plot([c["train_answer_tokens"] for c in curve], [_k3(c) for c in curve], "o-",
                    color=OURS, label="attention head")
    axs[1].set_title("attention head: tokens per verification (k = 3) by training tokens", fontsize=10)
    axs[1].set_xlabel("answer tokens trained on")
    axs[1].grid(alpha=0.3)
    _hline(axs[1], _k3(mlp), "MLP heads (shipped)", ls=":")
    rows = [_row(f"MLP heads (shipped): tokens per verification, k = 3 ({_how(mlp)})", _tpv(_k3(mlp)), "",
                 None, "", target, ">=", _k3(mlp)),
            _row(f"attention head: tokens per verification, k = 3 ({_how(att)})", _tpv(_k3(att)),
                 f"MLP heads {_tpv(_k3(mlp))}", _div(_k3(att), _k3(mlp)), "attention / MLP", target, ">=", _k3(att))]
    rows += [_row(f"chain accuracy by depth, {name}", ", ".join(_pct(a) for a in h.get("chain_accuracy") or []))
             for name, h in (("MLP heads", mlp), ("attention head", att))]
    rows += [_row(f"attention head trained on {_num(c['train_answer_tokens'])} answer tokens, k = 3",
                  _tpv(_k3(c))) for c in curve]
    return (f"train-mtp: draft heads offline (attention head: {recipe})", "On the model's own greedy MT-Bench answers: greedy verification "
            "replayed at k = 3 (what `bench spec` measures online, exactly), and chain accuracy per depth over "
            "every position (a chain is right at depth j when its first j drafts equal the model's argmax). "
            "Files from before the replay give the estimate from chain accuracy instead, which skipped targets "
            "outside the draft vocabulary and overstates what verification accepts.", rows, fig)


def _mtp_curve(d):
    """`train-mtp --curve N1,N2 --json` (MLP heads): a head per data size, measured offline on MT-Bench."""
    curve = sorted(d.get("curve") or [], key=lambda c: c["train_answer_tokens"])
    gen, before, target = d.get("generation") or {}, d.get("mlp_shipped_before") or {}, _target(d, "mean_accepted_k3")
    recipe = (f"taps {','.join(map(str, d['taps']))}, " if d.get("taps") else "") + f"{d.get('loss', 'hard')} loss"
    recipe += (f", {d['epochs']} epochs" if d.get("epochs") else "") + (", bf16" if d.get("precision") == "bf16" else "")
    fig, axs = _fig(1, f"MLP draft heads ({recipe}) by training data, offline on {d.get('mt_bench_answers', '?')} "
                       f"MT-Bench answers ({_num(d.get('mt_bench_answer_tokens'))} tokens)")
    axs[0].plot([c["train_answer_tokens"] for c in curve], [_k3(c) for c in curve], "o-", color=OURS, label="MLP heads")
    axs[0].set_xscale("log")
    axs[0].set_xlabel("answer tokens trained on")
    axs[0].set_ylabel("tokens per verification, k = 3")
    axs[0].grid(alpha=0.3)
    _hline(axs[0], _k3(before), "heads shipped before this run", ls=":")
    _hline(axs[0], target, f"target >= {_num(target)}")
    rows = [_row("self-distilled answer tokens generated (time, rate)", _num(gen.get("answer_tokens")),
                 f"{_num(gen.get('seconds'))} s, {_num(gen.get('tokens_per_s'))} tok/s")]
    rows += [_row(f"MLP heads trained on {_num(c['train_answer_tokens'])} answer tokens ({c.get('train_seconds')} s): "
                  f"k = 3, {_how(c)}", _num(_k3(c)), ", ".join(_pct(a) for a in c["chain_accuracy"]),
                  None, "", target, ">=", _k3(c)) for c in curve]
    rows.append(_row(f"heads shipped before this run: k = 3 ({_how(before)})", _num(_k3(before))))
    return (f"train-mtp: MLP draft heads ({recipe}) by training data", "Tokens per verification at k = 3 against the answer "
            "tokens the heads were trained on, each head measured offline on the model's own greedy MT-Bench "
            "answers as in the draft heads' figures (the replayed verification; the chain accuracy per depth "
            "beside it).", rows, fig)


BUILDERS = {"decode": _decode, "perplexity": _perplexity, "kv": _kv, "attention": _attention, "spec": _spec,
            "mtp-heads": _mtp_heads, "mtp-curve": _mtp_curve}
