"""The MTP heads' training data: the large prompt set, and its shards made, resumed and refused."""
import os

import pytest
import torch

from edge_cli.bench.spec import mt_bench_prompts
from edge_cli.mtp_chat import HUMANITIES, chat_prompts, written_kinds, written_prompts, written_rounds
from edge_cli.mtp_data import (_jobs, build_shards, first_prompts, job_blocks, large_prompts, load_shards,
                               prompt_messages, training_prompts)
from edge_runtime.errors import EdgeRuntimeError


@pytest.fixture
def native_backend(native_backend):
    """The session's backend reporting no tapped layers, as these tests' answers assume (a drafter loaded by a
    test elsewhere sets the taps its heads read); put back as it was afterwards."""
    kept, native_backend.model.taps = native_backend.model.taps, ()
    yield native_backend
    native_backend.model.taps = kept


def test_the_large_set_extends_the_small_one_and_holds_no_mt_bench_question():
    small, large = training_prompts(0), large_prompts(0)
    assert [m[-1]["content"] for m in large[:len(small)]] == small  # the shipped heads' prompts, first, unchanged
    assert len(large) > 20 * len(small) and large == large_prompts(0) and large != large_prompts(1)
    systems = [m[0]["content"] for m in large[len(small):] if m[0]["role"] == "system"]
    assert 0.2 < len(systems) / (len(large) - len(small)) < 0.3  # a quarter open with a persona
    assert all("{" not in m[-1]["content"] for m in large[len(small):])  # every template was filled
    bench = {" ".join(q.lower().split()) for q in mt_bench_prompts(80)}
    assert len(bench) == 80 and not bench & {" ".join(m[-1]["content"].lower().split()) for m in large}


def test_the_chat_set_is_seeded_varied_and_holds_no_mt_bench_question():
    chat = chat_prompts(0)
    assert len(chat) == len(set(chat)) > 6000 and chat == chat_prompts(0) and chat != chat_prompts(1)
    assert sorted(chat) != sorted(chat_prompts(1))  # other draws, not only another order
    assert len(chat_prompts(0, per_kind=100)) == 658  # the probe's list (bench-results/logs/chat-data-small)
    kinds = {"writing": "Write ", "roleplay": "Pretend you are ", "puzzle": "Explain your reasoning",
             "math": "Show your work", "code": " function that ", "extraction": "from this review as JSON",
             "science": "How does "}
    for kind, marker in kinds.items():
        assert sum(marker in p for p in chat) >= 10, kind
    assert sum(any(p.startswith(q) for q in HUMANITIES) for p in chat) == 4 * len(HUMANITIES)  # with each twist
    assert all("{" not in p or "JSON" in p for p in chat)  # every template was filled
    bench = {" ".join(q.lower().split()) for q in mt_bench_prompts(80)}
    assert not bench & {" ".join(p.lower().split()) for p in chat}
    assert prompt_messages("chat", 0) == [[{"role": "user", "content": p}] for p in chat]
    assert prompt_messages("large", 0) == large_prompts(0)
    with pytest.raises(ValueError, match="no sharded prompt set"):
        prompt_messages("small")


def test_the_written_set_is_distinct_seeded_and_far_from_every_mt_bench_question():
    """The written prompts: rounds of six kinds of 340, no prompt twice, a later round appended after the
    earlier ones' order (so `--prompts 2040` still answers round 1 as it was), and none close to an MT-Bench
    question (the evaluation set): difflib's ratio on words to the nearest of the 80 stays below 0.5 (0.48 at most
    today; a paraphrase of a question scores far above that)."""
    import difflib
    import random

    rounds = written_rounds()
    kinds = written_kinds()
    assert len(rounds) == 6 and all(len(r[k]) == 340 for r in rounds for k in r)
    assert sorted(kinds) == ["coding", "extraction", "knowledge", "reasoning_math", "roleplay", "writing"]
    assert all(kinds[k] == [p for r in rounds for p in r[k]] for k in kinds)
    written = written_prompts(0)
    assert len(written) == len({" ".join(p.lower().split()) for p in written}) == 12240
    assert sorted(written) == sorted(written_prompts(1)) and written == written_prompts(0) != written_prompts(1)
    first = [p for kind in sorted(rounds[0].items()) for p in kind[1]]
    random.Random(0).shuffle(first)  # round 1 alone, shuffled as when it was the whole set
    assert written[:2040] == first
    for n, later in enumerate(rounds[1:], 1):  # each later round after the ones before, in its own block
        assert set(written[2040 * n:2040 * (n + 1)]) == {p for k in later for p in later[k]}
    assert len({p for p in written[:200]} & set(kinds["coding"])) > 10  # shuffled: the first prompts mix the kinds
    bench = [q.lower().split() for q in mt_bench_prompts(80)]
    matcher = difflib.SequenceMatcher()
    for p in written:
        matcher.set_seq2(p.lower().split())
        for q in bench:
            matcher.set_seq1(q)
            if matcher.real_quick_ratio() >= 0.5 and matcher.quick_ratio() >= 0.5:
                assert matcher.ratio() < 0.5, (p, " ".join(q))
    paraphrase = bench[0][:-3] + ["for", "me", "please"]  # a question with its last words changed scores high
    matcher.set_seqs(bench[0], paraphrase)
    assert matcher.ratio() > 0.8
    assert prompt_messages("written", 0) == [[{"role": "user", "content": p}] for p in written]


def test_the_default_shard_folder_is_named_by_the_prompts_it_answers(tmp_path, monkeypatch):
    """`--prompts 0` (the whole set) names its folder by the set's count, so a set that grows (the written set's
    round 2) gets a folder of its own instead of one whose shards answer another job list."""
    from edge_cli.train_mtp import shard_folder

    monkeypatch.setenv("EDGE_RUNTIME_CACHE", str(tmp_path))
    count = len(written_prompts(0))
    assert shard_folder(0, (20, 26), "written") == str(tmp_path / f"mtp-written-{count}-taps20-26")
    assert shard_folder(2040, (), "written") == str(tmp_path / "mtp-written-2040")
    assert shard_folder(10 * count, (), "written") == str(tmp_path / f"mtp-written-{count}")  # --prompts past the set
    assert shard_folder(0, (20, 26), "written", temperatures=(0.0, 0.8, 0.8)) == str(
        tmp_path / f"mtp-written-{count}-taps20-26-temps0-0.8-0.8")  # other answers, another folder


def test_the_chat_set_answers_into_shards_of_its_own(tmp_path, native_backend):
    """--prompt-set chat goes through the same shards as the large set; its folder records the set, so a large
    folder neither takes its place nor lends it shards."""
    import json

    from edge_cli.main import main

    folder = tmp_path / "chat"
    assert main(["train-mtp", "--prompt-set", "chat", "--prompts", "2", "--max-tokens", "6", "--epochs", "0",
                 "--data", str(folder)]) == 0
    settings = json.loads((folder / "settings.json").read_text())
    assert settings["prompt_set"] == "chat" and settings["prompts"] == 2
    data = load_shards(str(folder))
    assert len(data["records"]) == 4  # 2 prompts, greedy and sampled
    assert all(0 < len(r["tokens"]) <= 6 for r in data["records"])
    with pytest.raises(EdgeRuntimeError, match="other settings"):  # the same folder for the large set
        build_shards(native_backend, str(folder), num_prompts=2, max_tokens=6, progress=lambda m: None)
    large = str(tmp_path / "large")
    said: list[str] = []
    build_shards(native_backend, large, num_prompts=2, max_tokens=6, progress=said.append, donors=[str(folder)])
    assert said and not any("copied" in m for m in said)


def test_shards_resume_where_they_stopped_and_refuse_other_settings(tmp_path, native_backend):
    folder = str(tmp_path / "shards")
    made = build_shards(native_backend, folder, num_prompts=3, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    names = sorted(n for n in os.listdir(folder) if n.startswith("shard-"))
    assert made["shards"] == 3 and names == ["shard-00000.pt", "shard-00001.pt", "shard-00002.pt"]
    first = load_shards(folder)
    assert len(first["records"]) == 6 and first["shards_present"] == 3  # 3 prompts, greedy and sampled
    assert first["generation_seconds"] > 0  # each shard's making time, summed
    for r in first["records"]:
        assert r["hidden"].shape == (len(r["tokens"]), 576) and 0 < len(r["tokens"]) <= 6
    for r in first["records"][:3]:  # the greedy answers come first: each token is the step's argmax
        assert torch.equal(r["tokens"], r["greedy"])
    os.remove(os.path.join(folder, "shard-00001.pt"))  # as if stopped before it was written
    before = os.path.getmtime(os.path.join(folder, "shard-00000.pt"))
    build_shards(native_backend, folder, num_prompts=3, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    again = load_shards(folder)
    assert os.path.getmtime(os.path.join(folder, "shard-00000.pt")) == before  # kept, not remade
    for a, b in zip(first["records"], again["records"]):  # the remade shard is the same, sampled answers too
        assert torch.equal(a["tokens"], b["tokens"]) and torch.equal(a["hidden"], b["hidden"])
    with pytest.raises(EdgeRuntimeError, match="other settings"):
        build_shards(native_backend, folder, num_prompts=3, max_tokens=7, shard_jobs=2, progress=lambda m: None)


def test_shards_another_prompt_count_already_answered_are_copied_not_answered_again(tmp_path, native_backend):
    """Jobs run temperature by temperature, so 3 prompts and 4 share the first shard (the greedy answers to
    prompts 0 and 1) and no other: a run for 4 copies that one from the folder for 3 and answers the rest."""
    three, four, other = (str(tmp_path / n) for n in ("three", "four", "other"))
    build_shards(native_backend, three, num_prompts=3, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    build_shards(native_backend, other, num_prompts=4, max_tokens=5, shard_jobs=2, progress=lambda m: None)
    said = []
    made = build_shards(native_backend, four, num_prompts=4, max_tokens=6, shard_jobs=2, progress=said.append,
                        donors=[three, other, four])
    assert made["shards"] == 4 and len(said) == 4
    assert said[0].endswith(f"copied from {three}") and not any("copied" in m for m in said[1:])
    with open(os.path.join(three, "shard-00000.pt"), "rb") as a, open(os.path.join(four, "shard-00000.pt"), "rb") as b:
        assert a.read() == b.read()
    fresh = str(tmp_path / "fresh")  # the copy equals answering those jobs
    build_shards(native_backend, fresh, num_prompts=4, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    for x, y in zip(load_shards(four)["records"], load_shards(fresh)["records"]):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["hidden"], y["hidden"])


def test_a_run_that_adds_a_temperature_copies_the_earlier_answers_and_samples_new_ones(tmp_path, native_backend):
    """Jobs run temperature by temperature, so answering 3 prompts at 0, 0.8 and 0.8 again starts with the jobs of
    0 and 0.8: those shards are copied, the rest are second samples (seeded by their own job numbers: other
    answers than the first samples'); a folder at other temperatures lends nothing."""
    two, three, hot = (str(tmp_path / n) for n in ("two", "three", "hot"))
    build_shards(native_backend, two, num_prompts=3, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    build_shards(native_backend, hot, num_prompts=3, max_tokens=6, shard_jobs=2, temperatures=(0.0, 1.0),
                 progress=lambda m: None)
    said = []
    made = build_shards(native_backend, three, num_prompts=3, max_tokens=6, shard_jobs=2, progress=said.append,
                        temperatures=(0.0, 0.8, 0.8), donors=[hot, two])
    assert made["shards"] == 5 and len(said) == 5
    assert [m.endswith(f"copied from {two}") for m in said] == [True, True, True, False, False]
    records = load_shards(three)["records"]
    assert len(records) == 9
    first, second = records[3:6], records[6:]
    assert any(not torch.equal(a["tokens"], b["tokens"]) for a, b in zip(first, second))
    for r in second:  # sampled: some token is not the step's argmax, and the rows are the answer's own
        assert r["hidden"].shape == (len(r["tokens"]), 576)
    assert any(not torch.equal(r["tokens"], r["greedy"]) for r in second)


def test_a_block_of_prompts_added_later_leaves_the_earlier_jobs_and_their_cut_as_they_were():
    ps, temps = list("abcde"), (0.0, 0.8)
    one, two = _jobs(ps[:3], temps), _jobs(ps, temps, [3, 2])
    assert two[:6] == one and [j[1] for j in two] == list(range(10))
    assert [(t, p) for t, _, p in two[6:]] == [(0.0, "d"), (0.0, "e"), (0.8, "d"), (0.8, "e")]
    assert _jobs(ps, temps)[3:6] != one[3:6]  # in one block the sampled half moves when prompts are added
    data = {"prompts": 5, "temperatures": list(temps), "blocks": [3, 2], "records": [f"{t}{p}" for t, _, p in two]}
    cut = first_prompts(data, 4)
    assert cut["records"] == ["0.0a", "0.0b", "0.0c", "0.8a", "0.8b", "0.8c", "0.0d", "0.8d"]
    assert cut["blocks"] == [3, 1] and cut["prompts"] == 4
    assert first_prompts(data, 2)["records"] == ["0.0a", "0.0b", "0.8a", "0.8b"]
    assert first_prompts(data, 2)["blocks"] == [2]
    plain = {"prompts": 3, "temperatures": list(temps), "records": [f"{t}{p}" for t, _, p in one]}
    assert first_prompts(plain, 2)["records"] == ["0.0a", "0.0b", "0.8a", "0.8b"] and "blocks" not in first_prompts(plain, 2)


def test_the_written_set_numbers_rounds_one_to_three_as_one_block_and_each_later_round_after_them():
    rounds = [sum(map(len, r.values())) for r in written_rounds()]
    first = sum(rounds[:3])
    assert job_blocks("written", first) == [first] and job_blocks("written", 2040) == [2040]
    assert job_blocks("written", sum(rounds)) == [first, *rounds[3:]]
    assert job_blocks("written", first + 100) == [first, 100][:1 + (len(rounds) > 3)]  # cut within round 4
    assert job_blocks("chat", 10 ** 6) == [10 ** 6]


def test_shards_of_a_grown_set_copy_every_earlier_job_when_the_new_prompts_are_a_block(tmp_path, native_backend,
                                                                                      monkeypatch):
    """With the third prompt in a block of its own, 3 prompts' jobs (greedy 0, 1 | sampled 0, 1 | greedy 2,
    sampled 2) start with all of 2 prompts' jobs: both of their shards are copied, and the cut back to 2 prompts
    is the 2-prompt run's answers."""
    from edge_cli import mtp_data

    monkeypatch.setattr(mtp_data, "job_blocks", lambda s, c: [min(c, 2)] + ([c - 2] if c > 2 else []))
    two, three = str(tmp_path / "two"), str(tmp_path / "three")
    build_shards(native_backend, two, num_prompts=2, max_tokens=6, shard_jobs=2, progress=lambda m: None,
                 prompt_set="written")
    said = []
    made = build_shards(native_backend, three, num_prompts=3, max_tokens=6, shard_jobs=2, progress=said.append,
                        donors=[two], prompt_set="written")
    assert made["shards"] == 3 and made["blocks"] == [2, 1]
    assert [m.endswith(f"copied from {two}") for m in said] == [True, True, False]
    grown, before = load_shards(three), load_shards(two)
    assert len(grown["records"]) == 6 and grown["blocks"] == [2, 1]
    for x, y in zip(first_prompts(grown, 2)["records"], before["records"], strict=True):
        assert torch.equal(x["tokens"], y["tokens"]) and torch.equal(x["hidden"], y["hidden"])
    assert torch.equal(grown["records"][4]["tokens"], grown["records"][4]["greedy"])  # the new prompt's greedy answer


def test_train_mtp_refuses_temperatures_that_are_not_numbers_in_range(capsys):
    from edge_cli.main import main

    for bad in ("0,hot", "", "0,-1", "0,3"):
        assert main(["train-mtp", "--prompt-set", "written", "--prompts", "1", "--temperatures", bad,
                     "--epochs", "0"]) == 2
        err = capsys.readouterr().err
        assert "--temperatures" in err and "Traceback" not in err


def test_the_vendored_mt_bench_file_is_read_and_a_missing_one_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    from edge_cli.bench import spec
    from edge_cli.main import main

    questions = mt_bench_prompts(80)
    assert len(questions) == 80 and questions[0].startswith("Compose an engaging travel blog post")
    monkeypatch.setattr(spec, "MT_BENCH", str(tmp_path / "gone.jsonl"))
    monkeypatch.setattr(spec.mt_bench_prompts, "__defaults__", (str(tmp_path / "gone.jsonl"),))
    assert main(["bench", "spec", "--questions", "2", "--grounded", "1"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "gone.jsonl is missing" in err and "Traceback" not in err


def test_a_dataset_cut_to_its_first_prompts_keeps_each_temperatures_answers_to_them():
    from edge_cli.mtp_data import first_prompts

    data = {"prompts": 3, "temperatures": [0.0, 0.8], "records": [f"t{t}p{p}" for t in (0, 1) for p in range(3)]}
    assert first_prompts(data, 2)["records"] == ["t0p0", "t0p1", "t1p0", "t1p1"]
    assert first_prompts(data, 2)["prompts"] == 2 and first_prompts(data, 3)["records"] == data["records"]


def test_taps_recomputed_from_untapped_shards_equal_answering_with_taps_on(tmp_path, native_backend):
    """`add_taps` runs the recorded answers again through the fused chunks: the final states come out equal to
    the recorded ones (checked), and the records equal answering with the taps on, bit for bit."""
    model = native_backend.model
    kept = model.taps
    plain = str(tmp_path / "plain")
    build_shards(native_backend, plain, num_prompts=2, max_tokens=6, shard_jobs=2, progress=lambda m: None)
    try:
        model.taps = (3, 20)
        derived = build_shards(native_backend, str(tmp_path / "derived"), num_prompts=2, max_tokens=6,
                               shard_jobs=2, progress=lambda m: None, donors=[plain])
        fresh = build_shards(native_backend, str(tmp_path / "fresh"), num_prompts=2, max_tokens=6, shard_jobs=2,
                             progress=lambda m: None)
        model.taps = (20,)  # from a donor with other taps: its answers, its final states checked, ours added
        narrow = build_shards(native_backend, str(tmp_path / "narrow"), num_prompts=2, max_tokens=6,
                              shard_jobs=2, progress=lambda m: None, donors=[str(tmp_path / "fresh")])
    finally:
        model.taps = kept
    assert derived["taps"] == fresh["taps"] == [3, 20] and narrow["taps"] == [20]
    a, b, c = (load_shards(str(tmp_path / n)) for n in ("plain", "derived", "fresh"))
    d = load_shards(str(tmp_path / "narrow"))
    assert d["tap_seconds"] > 0 and len(d["records"]) == 4
    for y, z in zip(d["records"], c["records"]):  # features [final | tap 20]: the (3, 20) rows' first and third
        assert torch.equal(y["hidden"], torch.cat([z["hidden"][:, :576], z["hidden"][:, 1152:]], 1))
    assert b["tap_seconds"] > 0 and c["tap_seconds"] == 0  # derived from the answers / answered with taps on
    assert len(a["records"]) == len(b["records"]) == len(c["records"]) == 4
    for x, y, z in zip(a["records"], b["records"], c["records"]):
        assert y["hidden"].shape == (len(x["tokens"]), 3 * 576)
        assert torch.equal(y["hidden"][:, :576], x["hidden"]) and torch.equal(y["hidden"], z["hidden"])
        assert torch.equal(x["tokens"], z["tokens"]) and torch.equal(x["greedy"], z["greedy"])
    assert not torch.equal(b["records"][0]["hidden"][:, 576:1152], b["records"][0]["hidden"][:, 1152:])
    bad = [{**r, "hidden": r["hidden"] + 1} for r in a["records"][:1]]  # answers another build made
    from edge_cli.mtp_data import _jobs, add_taps

    model.taps = (3,)
    try:
        with pytest.raises(EdgeRuntimeError, match="differ from the recorded ones"):
            add_taps(native_backend, _jobs(large_prompts(0)[:2], (0.0, 0.8))[:1], bad, 6)
    finally:
        model.taps = kept


def test_loaded_shards_map_their_rows_from_one_store_that_grows_with_the_shards(tmp_path, native_backend):
    """`load_shards` copies the shards' hidden rows once into `flat.f16` and maps it: each record's rows equal
    the shard's, a shard added later is appended (the rows already there are not rewritten), and bytes a run
    stopped while appending left past the index are cut off."""
    folder = str(tmp_path / "shards")
    build_shards(native_backend, folder, num_prompts=2, max_tokens=5, shard_jobs=1, progress=lambda m: None)
    os.remove(os.path.join(folder, "shard-00003.pt"))
    three = load_shards(folder)
    path = os.path.join(folder, "flat.f16")
    rows = sum(len(r["tokens"]) for r in three["records"])
    assert three["flat"].shape == (rows, 576) and os.path.getsize(path) == rows * 576 * 2
    with open(path, "ab") as f:
        f.write(b"left by a stopped run")
    build_shards(native_backend, folder, num_prompts=2, max_tokens=5, shard_jobs=1, progress=lambda m: None)
    four = load_shards(folder)
    assert four["shards_present"] == 4 and len(four["records"]) == 4
    assert os.path.getsize(path) == 2 * 576 * sum(len(r["tokens"]) for r in four["records"])
    for n, r in zip(sorted(x for x in os.listdir(folder) if x.startswith("shard-")), four["records"]):
        (want,) = torch.load(os.path.join(folder, n))["records"]
        assert torch.equal(r["hidden"], want["hidden"]) and torch.equal(r["tokens"], want["tokens"])
        assert torch.equal(four["flat"][r["row"]:r["row"] + len(r["tokens"])], want["hidden"])
    assert [r["row"] for r in four["records"][:3]] == [r["row"] for r in three["records"]]
    two = load_shards(folder, limit=2)  # the first shards' records only, from the same store
    assert two["shards_present"] == 2 and [r["row"] for r in two["records"]] == [r["row"] for r in four["records"][:2]]
    assert two["generation_seconds"] < four["generation_seconds"]
    part = str(tmp_path / "part")
    build_shards(native_backend, part, num_prompts=2, max_tokens=5, shard_jobs=1, progress=lambda m: None, limit=2)
    assert sorted(n for n in os.listdir(part) if n.startswith("shard-")) == ["shard-00000.pt", "shard-00001.pt"]
    from edge_cli.train_mtp import train  # heads trained from the mapped store equal heads trained in memory

    loaded = {**{k: v for k, v in four.items() if k != "flat"},
              "records": [torch.load(os.path.join(folder, f"shard-{k:05d}.pt"))["records"][0] for k in range(4)]}
    kw = dict(depth=2, hidden=32, draft_vocab=64, epochs=1, batch=4, progress=lambda m: None)
    (a, ra), (b, rb) = train(four, native_backend, **kw), train(loaded, native_backend, **kw)
    assert ra == rb and all(torch.equal(v, b.state_dict()[k]) for k, v in a.state_dict().items())
    c, rc = train(four, native_backend, **kw, precision="bf16")  # bf16 products: trains, other rounding
    assert rc["precision"] == "bf16" and rc["positions"] == ra["positions"]
    assert any(not torch.equal(v, c.state_dict()[k]) for k, v in a.state_dict().items() if v.is_floating_point())
