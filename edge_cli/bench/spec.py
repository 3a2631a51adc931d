"""`edge-runtime bench spec`: speculative decoding (MTP heads, n-gram prompt lookup) against plain decoding.

Two workloads, greedy, `--spec-tokens` tokens per answer, chat template on:
- the first turns of the 80 MT-Bench questions (`edge_runtime/data/mt_bench_questions.jsonl`, vendored),
- an input-grounded set: edit, summarize or rewrite a given passage (the module docstrings of
  Python's standard library, the same text on every machine with the same Python).

Per prompt every configuration runs back to back (so drifts of the machine hit all alike):
native plain, native MTP at a fixed k = `--draft-k` (acceptance figures), native MTP with the
adaptive draft length (what `--draft mtp` gives), the heads with prompt lookup at the fixed k
(`--draft mtp-ngram`'s acceptance figures; MT-Bench only) and adaptive (`--draft mtp-ngram`, `auto` until
2026-12-06), draft trees of a fixed `--tree-size` drafts (tree
acceptance figures) and of the adaptive size (what `--draft mtp-tree` gives; MT-Bench only), the attention
head's chains and prompt lookup with them, each at the fixed k and the adaptive length (`--draft mtp-attn`,
`mtp-attn-ngram`), and its trees, alone and with prompt lookup's chain as a branch, at the fixed and the adaptive
size (`mtp-attn-tree`, `mtp-attn-ngram-tree`; where that head ships), n-gram
on both engines, `--draft auto` (the default: `mtp-attn-ngram` with the adaptive length where the attention
head ships, else `mtp-ngram` where the MLP heads do, else n-gram), and llama.cpp plain
on the same GGUF with the same threads, in a worker process of its own (`LlamaWorker`: in this
process llama.cpp's OpenMP threads would share libgomp with the native engine's, whose second thread
pool puts libgomp's spin-waits into their throttled, near-passive mode: llama.cpp then decodes 3-4x
slower than it does for its users, alone). Decode speed is generated tokens after the first over
the time after the first token, summed over prompts. Every drafted run's tokens are compared
with the plain run's of the same engine: `identical` must be true for the native engine
(`lossless`). llama.cpp's n-gram row is measured but not offered to users: its batched rows
round differently from its one-token rows, and answers change.
"""
from __future__ import annotations

import inspect
import json
import os
import time

from edge_runtime import DATA_DIR
from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.request import GenerationRequest, SamplingParams

MT_BENCH = os.path.join(DATA_DIR, "mt_bench_questions.jsonl")  # vendored, Apache-2.0: see its LICENSE.txt
GROUNDED_MODULES = ["json", "csv", "argparse", "collections", "functools", "itertools", "pathlib", "shutil",
                    "subprocess", "logging", "datetime", "textwrap", "threading", "heapq", "bisect", "random"]
GROUNDED_TASKS = [
    "Fix any grammar or spelling mistakes in the following text and return the corrected text:\n\n{p}",
    "Summarize the following documentation in a short paragraph:\n\n{p}",
    "Rewrite the following text so that a beginner can follow it:\n\n{p}",
    "Copy the following text, replacing every technical term with a simpler word where possible:\n\n{p}",
]


def mt_bench_prompts(n: int, path: str = MT_BENCH) -> list[str]:
    """The first turns of the first `n` MT-Bench questions."""
    try:
        with open(path, encoding="utf-8") as f:
            return [json.loads(line)["turns"][0] for line in f if line.strip()][:n]
    except FileNotFoundError:
        raise EdgeRuntimeError(f"bench spec: the MT-Bench question file {path} is missing (it ships in the package; "
                               f"reinstall, or restore it from git)") from None


def grounded_prompts(n: int) -> list[str]:
    import importlib

    out = []
    for i, name in enumerate(GROUNDED_MODULES[:n]):
        doc = " ".join((inspect.getdoc(importlib.import_module(name)) or name).split())[:700]
        out.append(GROUNDED_TASKS[i % len(GROUNDED_TASKS)].format(p=doc))
    return out


class Tally:
    def __init__(self):
        self.tokens = self.seconds = 0.0
        self.proposed = self.accepted = self.verify_steps = 0
        self.pos_proposed, self.pos_accepted = [0] * 8, [0] * 8
        self.ids: list[list[int]] = []

    def add(self, result) -> None:
        t = result.timings
        n = result.usage.completion_tokens
        if n > 1:
            self.tokens += n - 1
            self.seconds += t["total_s"] - t["ttft_ms"] / 1000.0
        d = t.get("draft")
        if d:
            self.proposed += d["proposed"]
            self.accepted += d["accepted"]
            self.verify_steps += d["verify_steps"]
            for i in range(8):
                self.pos_proposed[i] += d["pos_proposed"][i]
                self.pos_accepted[i] += d["pos_accepted"][i]
        self.ids.append(result.token_ids)
        self.last = result

    def summary(self, reference: "Tally | None" = None) -> dict:
        out = {"tok_s": round(self.tokens / self.seconds, 2) if self.seconds else 0.0, "tokens": int(self.tokens)}
        if self.verify_steps:
            out["mean_accepted"] = round(self.accepted / self.verify_steps + 1.0, 3)
            out["acceptance_per_position"] = [round(self.pos_accepted[i] / self.pos_proposed[i], 3)
                                              for i in range(8) if self.pos_proposed[i]]
            out["verify_steps"] = self.verify_steps
        if reference is not None:
            out["identical"] = self.ids == reference.ids
            out["identical_answers"] = sum(a == b for a, b in zip(self.ids, reference.ids))
        return out


def _run(backend, draft: str, k: int | None, prompt: str, max_tokens: int, tally: Tally) -> None:
    backend.reset_prefix_cache()  # every run cold: a prefix-cache hit would change the prompt's arithmetic
    backend.set_draft(draft, k=k, allow_inexact=True)  # llama.cpp's n-gram row: measured, not offered
    req = GenerationRequest(messages=[{"role": "user", "content": prompt}],
                            params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
    tally.add(backend.generate(req))


def _trees(res: dict, mt: dict, tree: int, key: str, row: str, tally: str) -> dict:
    """One drafter's tree figures into `res`: its trees of `tree` drafts (tally `tally`_k: `key`.tree_mean_accepted,
    acceptance per depth, speed-up) and of the adaptive size (`tally`); returns the adaptive row."""
    plain = mt["plain"].summary()
    tk, ta = mt[f"{tally}_k"].summary(mt["plain"]), mt[tally].summary(mt["plain"])
    res["mt_bench"].update({f"native_{row}_{tree}": tk, f"native_{row}": ta})
    res[f"{key}.tree_mean_accepted"] = tk.get("mean_accepted", 0.0)
    res[f"{key}.tree_acceptance_per_depth"] = tk.get("acceptance_per_position", [])
    res[f"{key}.tree{tree}.speedup_over_plain"] = round(tk["tok_s"] / plain["tok_s"], 3)
    res[f"{key}.tree.speedup_over_plain"] = round(ta["tok_s"] / plain["tok_s"], 3)
    return ta


class LlamaWorker:
    """llama.cpp's rows, generated in a process of its own that lives for the whole run; the prompts go
    one at a time (a JSON line in, the result's figures and token ids back), so they still run between
    the native engine's rows of the same prompt while this process waits."""

    def __init__(self, model: str | None, threads: int):
        import subprocess
        import sys

        self.proc = subprocess.Popen([sys.executable, "-m", "edge_cli.bench.spec", "llama-worker", model or "",
                                      str(threads)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

    def generate(self, draft: str, prompt: str, max_tokens: int):
        from types import SimpleNamespace

        self.proc.stdin.write(json.dumps({"draft": draft, "prompt": prompt, "max_tokens": max_tokens}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise EdgeRuntimeError(f"bench spec: the llama.cpp worker exited (code {self.proc.wait()})")
        out = json.loads(line)
        if "error" in out:
            raise EdgeRuntimeError(f"bench spec: the llama.cpp worker: {out['error']}")
        return SimpleNamespace(timings=out["timings"], token_ids=out["token_ids"],
                               usage=SimpleNamespace(completion_tokens=out["completion_tokens"]))

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def _llama_worker(model: str, threads: int) -> None:
    """The worker's side of `LlamaWorker`: answers JSON lines on stdin with JSON lines on the stdout it
    started with (llama.cpp's own messages go to stderr)."""
    import sys

    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from edge_runtime.backends.llama_cpp import LlamaCppBackend

    llama = LlamaCppBackend(model=model or None, threads=threads)
    for line in sys.stdin:
        job = json.loads(line)
        try:
            t = Tally()
            _run(llama, job["draft"], None, job["prompt"], job["max_tokens"], t)
        except EdgeRuntimeError as e:
            out.write(json.dumps({"error": str(e)}) + "\n")
        else:
            r = t.last
            out.write(json.dumps({"timings": r.timings, "token_ids": r.token_ids,
                                  "completion_tokens": r.usage.completion_tokens}) + "\n")
        out.flush()


class _Rows:
    """`_run`'s backend interface over a `LlamaWorker`."""

    def __init__(self, worker: LlamaWorker):
        self.worker, self.draft = worker, "none"

    def reset_prefix_cache(self) -> None:  # the worker resets its own before every prompt
        pass

    def set_draft(self, draft, k=None, allow_inexact=False) -> None:
        self.draft = draft

    def generate(self, req):
        return self.worker.generate(self.draft, req.messages[0]["content"], req.params.max_tokens)


def run_spec_bench(args) -> int:
    from edge_runtime.backends.native import NativeBackend
    from edge_runtime.spec.attn_head import FORMAT as ATTN_FORMAT
    from edge_runtime.spec.mtp import find_heads

    questions, grounded = mt_bench_prompts(args.questions), grounded_prompts(args.grounded)  # before any model
    native = NativeBackend(model=args.model, threads=args.threads)
    worker = LlamaWorker(args.model, args.threads or native_threads())
    llama = _Rows(worker)
    has_mtp = find_heads(native) is not None
    has_attn = find_heads(native, ATTN_FORMAT) is not None
    n_tok, k, tree = args.spec_tokens, args.draft_k, args.tree_size
    mt = {name: Tally() for name in ("plain", "mtp_k", "mtp", "mtp_ngram_k", "mtp_ngram", "tree_k", "tree", "attn_k",
                                     "attn", "attn_ngram_k", "attn_ngram", "attn_tree_k", "attn_tree",
                                     "attn_ngram_tree_k", "attn_ngram_tree", "ngram", "auto", "llama_plain")}
    gr = {name: Tally() for name in ("plain", "ngram", "mtp", "mtp_ngram", "attn", "attn_ngram", "auto", "llama_plain",
                                     "llama_ngram")}
    t0 = time.time()
    for i, q in enumerate(questions):
        _run(native, "none", None, q, n_tok, mt["plain"])
        if has_mtp:
            _run(native, "mtp", k, q, n_tok, mt["mtp_k"])
            _run(native, "mtp", None, q, n_tok, mt["mtp"])
            _run(native, "mtp-ngram", k, q, n_tok, mt["mtp_ngram_k"])
            _run(native, "mtp-ngram", None, q, n_tok, mt["mtp_ngram"])  # auto before 2026-12-06's switch
            _run(native, "mtp-tree", tree, q, n_tok, mt["tree_k"])
            _run(native, "mtp-tree", None, q, n_tok, mt["tree"])
        if has_attn:
            _run(native, "mtp-attn", k, q, n_tok, mt["attn_k"])
            _run(native, "mtp-attn", None, q, n_tok, mt["attn"])
            _run(native, "mtp-attn-ngram", k, q, n_tok, mt["attn_ngram_k"])
            _run(native, "mtp-attn-ngram", None, q, n_tok, mt["attn_ngram"])
            _run(native, "mtp-attn-tree", tree, q, n_tok, mt["attn_tree_k"])
            _run(native, "mtp-attn-tree", None, q, n_tok, mt["attn_tree"])
            _run(native, "mtp-attn-ngram-tree", tree, q, n_tok, mt["attn_ngram_tree_k"])
            _run(native, "mtp-attn-ngram-tree", None, q, n_tok, mt["attn_ngram_tree"])
        _run(native, "ngram", None, q, n_tok, mt["ngram"])
        _run(native, "auto", None, q, n_tok, mt["auto"])
        _run(llama, "none", None, q, n_tok, mt["llama_plain"])
        print(f"  mt-bench {i + 1}/{len(questions)} ({time.time() - t0:.0f} s)", flush=True)
    for i, p in enumerate(grounded):
        _run(native, "none", None, p, n_tok, gr["plain"])
        _run(native, "ngram", None, p, n_tok, gr["ngram"])
        _run(native, "auto", None, p, n_tok, gr["auto"])
        if has_mtp:
            _run(native, "mtp", None, p, n_tok, gr["mtp"])
            _run(native, "mtp-ngram", None, p, n_tok, gr["mtp_ngram"])
        if has_attn:
            _run(native, "mtp-attn", None, p, n_tok, gr["attn"])
            _run(native, "mtp-attn-ngram", None, p, n_tok, gr["attn_ngram"])
        _run(llama, "none", None, p, n_tok, gr["llama_plain"])
        _run(llama, "ngram", None, p, n_tok, gr["llama_ngram"])
        print(f"  grounded {i + 1}/{len(grounded)} ({time.time() - t0:.0f} s)", flush=True)
    worker.close()
    plain, lplain = mt["plain"].summary(), mt["llama_plain"].summary()
    gplain, glplain = gr["plain"].summary(), gr["llama_plain"].summary()
    res = {
        "workloads": {"mt_bench_first_turns": len(questions), "grounded": len(grounded), "max_tokens": n_tok,
                      "greedy": True, "threads": args.threads or native_threads(), "draft_k": k, "tree_size": tree,
                      "llama_cpp": "in a worker process of its own, prompts interleaved with the native rows"},
        "targets": {"mtp.mean_accepted": 2.5, "mtp.tree_mean_accepted": 3.0, "mtp.speedup_over_plain": 1.6,
                    "mtp.speedup_over_llama_cpp": 2.0, "ngram.speedup_over_plain_grounded": 2.0},
        "mt_bench": {"native_plain": plain, "llama_cpp_plain": lplain,
                     "native_ngram": mt["ngram"].summary(mt["plain"]), "native_auto": mt["auto"].summary(mt["plain"])},
        "grounded": {"native_plain": gplain, "llama_cpp_plain": glplain,
                     "native_ngram": gr["ngram"].summary(gr["plain"]), "native_auto": gr["auto"].summary(gr["plain"]),
                     "llama_cpp_ngram": gr["llama_ngram"].summary(gr["llama_plain"])},
    }
    ng = res["grounded"]["native_ngram"]
    res["ngram.speedup_over_plain_grounded"] = round(ng["tok_s"] / gplain["tok_s"], 3)
    res["auto.speedup_over_plain"] = round(res["mt_bench"]["native_auto"]["tok_s"] / plain["tok_s"], 3)
    res["auto.speedup_over_plain_grounded"] = round(res["grounded"]["native_auto"]["tok_s"] / gplain["tok_s"], 3)
    res["auto.speedup_over_llama_cpp"] = round(res["mt_bench"]["native_auto"]["tok_s"] / lplain["tok_s"], 3)
    native.set_draft("auto")
    res["auto.method"] = native.draft  # what auto resolved to on this machine and model
    res["ngram.llama_cpp_speedup_over_plain_grounded"] = round(
        res["grounded"]["llama_cpp_ngram"]["tok_s"] / glplain["tok_s"], 3)
    if has_mtp:
        mk, ma = mt["mtp_k"].summary(mt["plain"]), mt["mtp"].summary(mt["plain"])
        res["mt_bench"].update({f"native_mtp_k{k}": mk, "native_mtp": ma})
        res["grounded"]["native_mtp"] = gr["mtp"].summary(gr["plain"])
        res["mtp.mean_accepted"] = mk.get("mean_accepted", 0.0)
        res["mtp.acceptance_per_position"] = mk.get("acceptance_per_position", [])
        res["mtp.speedup_over_plain"] = round(ma["tok_s"] / plain["tok_s"], 3)
        res["mtp.speedup_over_llama_cpp"] = round(ma["tok_s"] / lplain["tok_s"], 3)
        res[f"mtp.k{k}.speedup_over_plain"] = round(mk["tok_s"] / plain["tok_s"], 3)
        nk = mt["mtp_ngram_k"].summary(mt["plain"])
        res["mt_bench"][f"native_mtp_ngram_k{k}"] = nk
        res["mtp_ngram.mean_accepted"] = nk.get("mean_accepted", 0.0)
        res["mtp_ngram.acceptance_per_position"] = nk.get("acceptance_per_position", [])
        res[f"mtp_ngram.k{k}.speedup_over_plain"] = round(nk["tok_s"] / plain["tok_s"], 3)
        na, gna = mt["mtp_ngram"].summary(mt["plain"]), gr["mtp_ngram"].summary(gr["plain"])
        res["mt_bench"]["native_mtp_ngram"], res["grounded"]["native_mtp_ngram"] = na, gna
        res["mtp_ngram.speedup_over_plain"] = round(na["tok_s"] / plain["tok_s"], 3)
        res["mtp_ngram.speedup_over_plain_grounded"] = round(gna["tok_s"] / gplain["tok_s"], 3)
        ta = _trees(res, mt, tree, "mtp", "mtp_tree", "tree")
        res["mtp.tree.speedup_over_llama_cpp"] = round(ta["tok_s"] / lplain["tok_s"], 3)
    else:
        res["mtp"] = "no MTP heads ship for this model: run `edge-runtime train-mtp`"
    if has_attn:  # the attention head's chains (--draft mtp-attn)
        ak, aa = mt["attn_k"].summary(mt["plain"]), mt["attn"].summary(mt["plain"])
        res["mt_bench"].update({f"native_mtp_attn_k{k}": ak, "native_mtp_attn": aa})
        res["grounded"]["native_mtp_attn"] = gr["attn"].summary(gr["plain"])
        res["mtp_attn.mean_accepted"] = ak.get("mean_accepted", 0.0)
        res["mtp_attn.acceptance_per_position"] = ak.get("acceptance_per_position", [])
        res[f"mtp_attn.k{k}.speedup_over_plain"] = round(ak["tok_s"] / plain["tok_s"], 3)
        res["mtp_attn.speedup_over_plain"] = round(aa["tok_s"] / plain["tok_s"], 3)
        res["mtp_attn.speedup_over_llama_cpp"] = round(aa["tok_s"] / lplain["tok_s"], 3)
        nk, na = mt["attn_ngram_k"].summary(mt["plain"]), mt["attn_ngram"].summary(mt["plain"])
        res["mt_bench"].update({f"native_mtp_attn_ngram_k{k}": nk, "native_mtp_attn_ngram": na})
        res["grounded"]["native_mtp_attn_ngram"] = gr["attn_ngram"].summary(gr["plain"])
        res["mtp_attn_ngram.mean_accepted"] = nk.get("mean_accepted", 0.0)
        res[f"mtp_attn_ngram.k{k}.speedup_over_plain"] = round(nk["tok_s"] / plain["tok_s"], 3)
        res["mtp_attn_ngram.speedup_over_plain"] = round(na["tok_s"] / plain["tok_s"], 3)
        res["mtp_attn_ngram.speedup_over_plain_grounded"] = round(
            res["grounded"]["native_mtp_attn_ngram"]["tok_s"] / gplain["tok_s"], 3)
        _trees(res, mt, tree, "mtp_attn", "mtp_attn_tree", "attn_tree")
        _trees(res, mt, tree, "mtp_attn_ngram", "mtp_attn_ngram_tree", "attn_ngram_tree")
    res["lossless"] = all(v.get("identical", True) for w in ("mt_bench", "grounded") for name, v in res[w].items()
                          if isinstance(v, dict) and name.startswith("native"))
    res["grounded"]["llama_cpp_ngram"]["note"] = (
        "not offered: llama.cpp's batched rows differ from its one-token rows, so answers can change")
    from edge_cli.bench.decode import machine

    res["machine"] = machine()
    text = json.dumps(res, indent=2)
    print(text)
    if args.json_file:
        with open(args.json_file, "w", encoding="utf-8") as f:
            f.write(text + "\n")
    return 0 if res["lossless"] else 1


def native_threads() -> int:
    import torch

    return torch.get_num_threads()


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["llama-worker"]:
        _llama_worker(sys.argv[2], int(sys.argv[3]))
