"""Training data for the MTP heads: the model's own answers, with its hidden states (self-distillation).

Prompts come only from text shipped in this repository (never MT-Bench, the
evaluation set): the labelled routing prompts, instruction templates over a
fixed list of topics, and edit / summarize / rewrite tasks over passages of
the GPL text in `edge_runtime/data`. For each prompt the model answers (greedy
for most, sampled for some variety) and every step records what an MTP head
sees and must predict:

- `hidden[i]`: the final-normed hidden state whose logits chose answer token i,
- `tokens[i]`: answer token i (what the step actually continued with),
- `greedy[i]`: the model's argmax at that step (equal to tokens[i] when greedy),

so a head given (hidden[i], tokens[i]) learns greedy[i + 1], then, chained,
greedy[i + 2] ... Everything is seeded: the same command gives the same data.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time

import numpy as np
import torch

from edge_runtime import DATA_DIR
from edge_runtime.errors import EdgeRuntimeError
from edge_runtime.spec.mtp import base_fingerprint
from edge_runtime.engine.completion import build_prompt, prompt_ids
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.engine.sampler import Sampler


TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "compound interest", "the French Revolution",
    "how vaccines work", "machine learning", "the stock market", "climate change", "the human heart",
    "recursion in programming", "the Roman Empire", "volcanoes", "electric cars", "the internet",
    "sleep", "coffee", "chess openings", "gardening", "renewable energy", "the moon landing",
    "honeybees", "inflation", "public speaking", "time management", "the immune system", "rainbows",
    "plate tectonics", "databases", "the Great Wall of China", "healthy breakfast ideas", "origami",
    "a trip to Japan", "learning a new language", "the solar system", "bread baking", "earthquakes",
    "sorting algorithms", "the printing press", "friendship", "ocean tides", "job interviews",
]
TEMPLATES = [
    "Explain {t} to a ten-year-old.", "Write a short paragraph about {t}.", "Give me three facts about {t}.",
    "What are the pros and cons of {t}?", "Write a short poem about {t}.", "Summarize the history of {t}.",
    "List five tips related to {t}.", "Write a short story that involves {t}.",
    "What is the most common misconception about {t}?", "Describe {t} in simple terms.",
]
PASSAGE_TASKS = [
    "Summarize the following passage in two sentences:\n\n{p}",
    "Rewrite the following passage in plain, simple English:\n\n{p}",
    "Fix any typos and improve the wording of this text, keeping its meaning:\n\n{p}",
    "Extract the key points of this text as a bulleted list:\n\n{p}",
    "Repeat the following text exactly, then give it a title:\n\n{p}",
]


def passages(min_chars: int = 300, max_chars: int = 900) -> list[str]:
    with open(os.path.join(DATA_DIR, "gpl-3.0.txt"), encoding="utf-8") as f:
        paras = [" ".join(p.split()) for p in f.read().split("\n\n")]
    out, cur = [], ""
    for p in paras:
        cur = f"{cur}\n\n{p}".strip() if cur else p
        if len(cur) >= min_chars:
            out.append(cur[:max_chars])
            cur = ""
    return out


def training_prompts(seed: int = 0) -> list[str]:
    """The small set (782 prompts; the shipped heads' data), in a fixed order (shuffled with `seed`)."""
    with open(os.path.join(DATA_DIR, "routing_prompts.jsonl"), encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    prompts += [tpl.format(t=t) for t in TOPICS for tpl in TEMPLATES]
    prompts += [task.format(p=p) for i, p in enumerate(passages()) for task in PASSAGE_TASKS[i % 2::2]]
    random.Random(seed).shuffle(prompts)
    return prompts


def large_prompts(seed: int = 0) -> list[list[dict]]:
    """The large set, as message lists: the small set, then `mtp_prompts.json`'s templates over its topics and
    its self-contained tasks; a quarter of the new ones (seeded) open with one of its personas as the system
    prompt. Shuffled with `seed`; the small set comes first, unchanged, so its answers are the same."""
    with open(os.path.join(DATA_DIR, "mtp_prompts.json"), encoding="utf-8") as f:
        spec = json.load(f)
    rng = random.Random(seed)
    extra = [tpl.format(t=t) for t in spec["topics"] for tpl in spec["templates"]] + list(spec["tasks"])
    rng.shuffle(extra)
    out = [[{"role": "user", "content": p}] for p in training_prompts(seed)]
    for p in extra:
        system = [{"role": "system", "content": rng.choice(spec["personas"])}] if rng.random() < 0.25 else []
        out.append(system + [{"role": "user", "content": p}])
    return out


TEMPERATURES = (0.0, 0.8)  # the default: a greedy answer and one sampled at 0.8 per prompt
PROMPT_SETS = ("large", "chat", "written")  # the sets answered into shards (build_shards); "small" is one file


def prompt_messages(prompt_set: str, seed: int = 0) -> list[list[dict]]:
    """A sharded prompt set as message lists: "large" (`large_prompts`), "chat" (edge_cli/mtp_chat.py's
    chat-like prompts from templates) or "written" (its prompts written one by one), one user turn each."""
    if prompt_set == "large":
        return large_prompts(seed)
    if prompt_set == "chat":
        from edge_cli.mtp_chat import chat_prompts

        return [[{"role": "user", "content": p}] for p in chat_prompts(seed)]
    if prompt_set == "written":
        from edge_cli.mtp_chat import written_prompts

        return [[{"role": "user", "content": p}] for p in written_prompts(seed)]
    raise ValueError(f"no sharded prompt set {prompt_set!r}: {' or '.join(PROMPT_SETS)}")


class _Answer:
    def __init__(self, index: int, ids: list[int], table: list[int], temperature: float, seed: int, max_tokens: int):
        self.index, self.history, self.table, self.max_tokens = index, list(ids), table, max_tokens
        self.sampler = Sampler(SamplingParams(temperature=temperature, max_tokens=max_tokens, seed=seed))
        self.hs, self.toks, self.greedy = [], [], []
        self.logits = self.hidden = None

    def sample(self, eog: set[int], n_ctx: int) -> bool:
        """Draws the next token from self.logits and records it; False when the answer is over."""
        token = self.sampler.sample(self.logits, self.history)
        self.hs.append(self.hidden.clone())
        self.toks.append(token)
        self.greedy.append(int(torch.argmax(self.logits)))
        self.history.append(token)
        return token not in eog and len(self.toks) < self.max_tokens and len(self.history) < n_ctx

    def record(self, dtype: torch.dtype = torch.float16) -> dict:
        return {"hidden": torch.stack(self.hs).to(dtype), "tokens": torch.tensor(self.toks),
                "greedy": torch.tensor(self.greedy)}


@torch.inference_mode()
def answer_jobs(backend, jobs: list[tuple], max_tokens: int, seed: int, batch: int = 8, progress=print,
                hidden_dtype: torch.dtype = torch.float16) -> list[dict]:
    """The records of `jobs` [(temperature, job number, messages)], in order; job n samples with seed + n.

    Up to `batch` answers decode together through the fused batched step (each row computed exactly
    as a lone one-token step, so the records equal what single-stream decoding would give). The hidden
    rows are kept as `hidden_dtype`: fp16 halves the training shards; fp32 keeps them as the engine has them."""
    model, runner = backend.model, backend.runner
    if model.fused is None:
        raise RuntimeError("building MTP data needs the fused GGUF decode step (x86-64 with AVX2)")
    span = -(-(runner.n_ctx) // model.kv.block_size)  # blocks per slot: one full context each
    if model.kv.num_blocks < batch * span:
        batch = max(1, model.kv.num_blocks // span)
    tables = [list(range(s * span, (s + 1) * span)) for s in range(batch)]
    runner.reset()  # the slots use blocks directly: nothing of the runner's may be live
    records: list = [None] * len(jobs)
    live: dict[int, _Answer] = {}
    nxt, done, tokens = 0, 0, 0
    while nxt < len(jobs) or live:
        for slot in range(batch):  # fill free slots: prefill, then the first token
            while slot not in live and nxt < len(jobs):
                temp, n, messages = jobs[nxt]
                ids = _prompt(backend, messages, max_tokens)
                a = _Answer(nxt, ids, tables[slot], temp, seed + n, max_tokens)
                a.logits = model(torch.tensor(ids), 0, block_table=a.table)[-1].float()
                a.hidden = model.last_hidden.float()
                nxt += 1
                if a.sample(runner.eog_ids, runner.n_ctx):
                    live[slot] = a
                else:
                    records[a.index], done = a.record(hidden_dtype), done + 1
        if not live:
            continue
        slots = sorted(live)
        rows = [live[s] for s in slots]
        logits = model.fused.step_batch([a.history[-1] for a in rows], [len(a.history) - 1 for a in rows],
                                        [a.table for a in rows])
        hidden = model.fused.batch_hidden
        for r, (slot, a) in enumerate(zip(slots, rows)):
            a.logits, a.hidden = logits[r], hidden[r]
            tokens += 1
            if not a.sample(runner.eog_ids, runner.n_ctx):
                records[a.index], done = a.record(hidden_dtype), done + 1
                del live[slot]
                if progress and done % 40 == 0:
                    progress(f"  {done}/{len(jobs)} answers, {tokens} tokens")
    runner.reset()
    return records


def _prompt(backend, messages: list[dict], max_tokens: int) -> list[int]:
    """A job's prompt ids, cut to leave `max_tokens` of the context for the answer."""
    req = GenerationRequest(messages=messages, params=SamplingParams())
    return prompt_ids(backend.runner, build_prompt(req, backend.template))[:backend.runner.n_ctx - max_tokens - 1]


@torch.inference_mode()
def add_taps(backend, jobs: list[tuple], records: list[dict], max_tokens: int) -> list[dict]:
    """`records` (answers to `jobs`, made without taps or with others) with the layers of `backend.model.taps` in
    each hidden row (`transformer.features`), by running prompt and answer again through the fused step's chunks,
    whose rows are the one-token step's bit for bit: so the result equals answering with the taps on, and the
    final states must come out equal to the recorded ones (checked; a mismatch raises)."""
    model, runner = backend.model, backend.runner
    out = []
    for (_, _, messages), r in zip(jobs, records):
        ids, n = _prompt(backend, messages, max_tokens), len(r["tokens"])
        runner.reset()
        model.fused.step_chunk(ids + r["tokens"][:n - 1].tolist(), 0, model.identity_table, head="last")
        wide = model.fused.chunk_hidden[len(ids) - 1:len(ids) - 1 + n].to(r["hidden"].dtype)
        if not torch.equal(wide[:, :model.cfg.dim], r["hidden"][:, :model.cfg.dim]):  # a donor's own taps follow
            raise EdgeRuntimeError("train-mtp: the answers recomputed with taps differ from the recorded ones "
                                   "(another build or arithmetic made the shards): answer them again")
        out.append({**r, "hidden": wide})
    runner.reset()
    return out


def _jobs(prompts: list, temperatures: tuple, blocks: list[int] | None = None) -> list[tuple]:
    """One job per (temperature, prompt), numbered block by block of `blocks` prompts (default: one block of all
    of them) and in each block temperature by temperature (the number seeds its sampling): a block added after
    the others leaves every earlier job's number as it was."""
    out, start = [], 0
    for size in blocks or [len(prompts)]:
        part = prompts[start:start + size]
        out += [(t, len(out) + n, p) for n, (t, p) in enumerate((t, p) for t in temperatures for p in part)]
        start += size
    return out


def job_blocks(prompt_set: str, count: int) -> list[int]:
    """The blocks `_jobs` numbers a set's first `count` prompts in: one for all of them, except the written
    set past its third round: rounds 1 to 3 are one block (the job order their shipped heads were answered in),
    each later round a block of its own, so a round added later answers only its own prompts."""
    if prompt_set != "written":
        return [count]
    from edge_cli.mtp_chat import written_rounds

    rounds = [sum(map(len, r.values())) for r in written_rounds()]
    out = []
    for size in [sum(rounds[:3])] + rounds[3:]:
        if count > 0:
            out.append(min(size, count))
        count -= size
    return out


def build_dataset(backend, out_path: str, num_prompts: int | None = None, max_tokens: int = 160,
                  temperatures: tuple = TEMPERATURES, seed: int = 0, batch: int = 8, progress=print) -> dict:
    """Answers to the first `num_prompts` prompts of the small set, once per temperature, saved with torch.save."""
    prompts = training_prompts(seed)[:num_prompts]
    jobs = _jobs([[{"role": "user", "content": p}] for p in prompts], temperatures)
    records = answer_jobs(backend, jobs, max_tokens, seed, batch, progress)
    data = {"records": records, "prompts": len(prompts), "temperatures": list(temperatures), "seed": seed,
            "max_tokens": max_tokens}
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    torch.save(data, out_path)
    return data


def first_prompts(data: dict, n: int) -> dict:
    """`data` cut to the answers to its first `n` prompts (its records run in job order: block by block of
    `data["blocks"]`, default one, and in each block temperature by temperature)."""
    T, recs, out, cut, start, at = len(data["temperatures"]), data["records"], [], [], 0, 0
    for size in data.get("blocks") or [data["prompts"]]:
        take = max(0, min(size, n - start))  # this block's prompts among the first n
        cut += [take] if take else []
        out += [recs[at + t * size + i] for t in range(T) for i in range(take) if at + t * size + i < len(recs)]
        start, at = start + size, at + T * size
    return {**data, "prompts": n, "records": out, **({"blocks": cut} if "blocks" in data else {})}


def build_shards(backend, out_dir: str, num_prompts: int | None = None, max_tokens: int = 160,
                 temperatures: tuple = TEMPERATURES, seed: int = 0, shard_jobs: int = 256, batch: int = 16,
                 progress=print, donors: tuple[str, ...] = (), limit: int | None = None,
                 prompt_set: str = "large") -> dict:
    """Answers to `prompt_set` (one of PROMPT_SETS), in shards of `shard_jobs` answers (`shard-00000.pt` ...),
    for data at scale.

    Resumable: a shard already on disk is kept (each is written whole, then renamed), so the command can be
    stopped and run again, on this machine or another, and goes on where it was; `settings.json` records what
    the shards are answers to, and a folder made with other settings is refused. Returns the settings with
    the number of shards and answer tokens on disk. With `backend.model.taps` the hidden rows carry those
    layers too. A shard whose jobs one of the `donors` folders already answered (same model, seed, answer
    length and shard size; another prompt count whose job list holds the same jobs at that place) is taken
    from there rather than generated: copied when the donor has the same taps, recomputed from its answers
    (`add_taps`, a few times faster than answering) when it has other taps or none. `limit`: make the first
    `limit` shards only (a data size that is a prefix of the job list; the rest can follow in a later run)."""
    taps = list(backend.model.taps)
    prompts = prompt_messages(prompt_set, seed)[:num_prompts]
    blocks = job_blocks(prompt_set, len(prompts))
    jobs = _jobs(prompts, temperatures, blocks)
    settings = {"prompt_set": prompt_set, "prompts": len(prompts), "temperatures": list(temperatures), "seed": seed,
                "max_tokens": max_tokens, "shard_jobs": shard_jobs, "model": base_fingerprint(backend)}
    if len(blocks) > 1:  # (a folder of one block, as all were before blocks, keeps its settings)
        settings["blocks"] = blocks
    if taps:
        settings["taps"] = taps
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, "settings.json")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            old = json.load(f)
        if old != settings:
            raise EdgeRuntimeError(f"train-mtp: {out_dir} holds shards made with other settings ({old}); use "
                                   f"another --data folder")
    else:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(settings, f, indent=1)
    shards = -(-len(jobs) // shard_jobs)
    donor_jobs = _donors(settings, donors, out_dir)
    for k in range(min(shards, limit or shards)):
        base = f"shard-{k:05d}.pt"
        name = os.path.join(out_dir, base)
        if os.path.exists(name):
            continue
        part = jobs[k * shard_jobs:(k + 1) * shard_jobs]
        t0 = time.time()
        source = next(((os.path.join(f, base), t) for f, t, dj in donor_jobs
                       if os.path.exists(os.path.join(f, base)) and dj[k * shard_jobs:(k + 1) * shard_jobs] == part), None)
        if source and source[1] == taps:  # the same answers with the same features: copied
            shutil.copyfile(source[0], name + ".tmp")
            os.replace(name + ".tmp", name)
            progress(f"  shard {k + 1}/{shards}: copied from {os.path.dirname(source[0])}")
            continue
        if source:
            done = torch.load(source[0])
            records = add_taps(backend, part, done["records"], max_tokens)
            meta = {"seconds": done["seconds"], "tap_seconds": time.time() - t0}  # answering, then the taps
        else:
            records = answer_jobs(backend, part, max_tokens, seed, batch, progress=None)
            meta = {"seconds": time.time() - t0}
        torch.save({"records": records, "jobs": [part[0][1], part[-1][1] + 1], **meta}, name + ".tmp")
        os.replace(name + ".tmp", name)
        progress(f"  shard {k + 1}/{shards}: {sum(len(r['tokens']) for r in records)} answer tokens")
    return {**settings, "shards": shards}


def _donors(settings: dict, folders, out_dir: str) -> list[tuple[str, list, list]]:
    """(folder, its taps, its job list) for each of `folders` whose shards can stand in for ours: made for the
    same model, seed, answer length and shard size, with any taps (ours first: copied; others give their answers),
    at our temperatures or the first of them (a run that adds a temperature keeps the earlier answers: theirs first)."""
    varying = ("prompts", "taps", "temperatures", "blocks")
    fixed = {k: v for k, v in settings.items() if k not in varying}
    every, out = prompt_messages(settings["prompt_set"], settings["seed"]), []  # read once for all donors
    for folder in folders:
        path = os.path.join(folder, "settings.json")
        if os.path.abspath(folder) == os.path.abspath(out_dir) or not os.path.exists(path):
            continue
        with open(path, encoding="utf-8") as f:
            other = json.load(f)
        taps, temps = other.get("taps", []), other["temperatures"]
        same = {k: v for k, v in other.items() if k not in varying} == fixed
        if same and temps == settings["temperatures"][:len(temps)]:
            out.append((folder, taps, _jobs(every[:other["prompts"]], tuple(temps), other.get("blocks"))))
    return sorted(out, key=lambda d: d[1] != settings.get("taps", []))  # copies first


def load_shards(out_dir: str, limit: int | None = None) -> dict:
    """Every shard in `out_dir` as one dataset (the records of the shards present, in job order), with
    `generation_seconds`: the time the shards took to make (summed over the runs that made them), and
    `tap_seconds`: the time spent adding taps to answers made without them (`add_taps`).

    The hidden rows are not held in memory: the shards' rows are copied once into `flat.f16` (fp16 [R, W],
    appended to as shards are added; `flat.pt` indexes it) and memory-mapped, so millions of positions train
    on a machine with less memory than they take. `flat` is that store; each record's "hidden" is a view of
    it and "row" its first row there (`train_mtp.flatten`). `limit`: the records of the first `limit` shards."""
    with open(os.path.join(out_dir, "settings.json"), encoding="utf-8") as f:
        settings = json.load(f)
    names = sorted(n for n in os.listdir(out_dir) if n.startswith("shard-") and n.endswith(".pt"))
    index_path, flat_path = os.path.join(out_dir, "flat.pt"), os.path.join(out_dir, "flat.f16")
    index = torch.load(index_path) if os.path.exists(index_path) else None
    if (index is None or index["names"] != names[:len(index["names"])] or not os.path.exists(flat_path)
            or os.path.getsize(flat_path) < 2 * index["rows"] * index["width"]):
        index = {"names": [], "rows": 0, "width": 0, "records": [], "counts": [], "seconds": [], "tap_seconds": []}
    if names[len(index["names"]):]:
        with open(flat_path, "r+b" if index["names"] else "wb") as f:
            f.seek(2 * index["rows"] * index["width"])
            f.truncate()  # what a run stopped while appending left past the indexed rows
            for n in names[len(index["names"]):]:
                shard = torch.load(os.path.join(out_dir, n))
                for r in shard["records"]:
                    f.write(r["hidden"].to(torch.float16).contiguous().numpy().tobytes())
                    index["width"] = r["hidden"].shape[1]
                    index["records"].append({"tokens": r["tokens"], "greedy": r["greedy"], "row": index["rows"]})
                    index["rows"] += len(r["tokens"])
                index["names"].append(n)
                index["counts"].append(len(shard["records"]))
                index["seconds"].append(shard.get("seconds", 0.0))
                index["tap_seconds"].append(shard.get("tap_seconds", 0.0))
        torch.save(index, index_path + ".tmp")
        os.replace(index_path + ".tmp", index_path)
    if index["rows"]:
        flat = torch.from_numpy(np.memmap(flat_path, dtype=np.float16, mode="c", shape=(index["rows"], index["width"])))
    else:
        flat = torch.zeros(0, index["width"], dtype=torch.float16)
    n = min(len(names), limit or len(names))
    records = [{**r, "hidden": flat[r["row"]:r["row"] + len(r["tokens"])]}
               for r in index["records"][:sum(index["counts"][:n])]]
    return {**settings, "records": records, "flat": flat, "shards_present": n,
            "generation_seconds": sum(index["seconds"][:n]), "tap_seconds": sum(index["tap_seconds"][:n])}
