"""MTP heads: the training command end to end (tiny), the file format, loading rules, drafting."""
import pytest
import torch

from edge_cli.main import main
from edge_runtime.spec.mtp import FORMAT, MtpDrafter, MtpHead, base_fingerprint, find_heads
from edge_cli.train_mtp import expected_accepted


def test_train_mtp_writes_heads_that_load_and_draft(tmp_path, native_backend):
    data, out = tmp_path / "answers.pt", tmp_path / "heads.safetensors"
    rc = main(["train-mtp", "--prompts", "4", "--max-tokens", "12", "--epochs", "1", "--hidden", "64",
               "--draft-vocab", "256", "--data", str(data), "--out", str(out)])
    assert rc == 0 and data.exists() and out.exists()
    recs = torch.load(data)["records"]
    assert len(recs) == 8  # 4 prompts, greedy and sampled
    for r in recs:  # one hidden state per answer token, and greedy answers follow their own argmax
        assert r["hidden"].shape == (len(r["tokens"]), 576) and len(r["greedy"]) == len(r["tokens"])
    for r in recs[:4]:  # the greedy answers come first: each token is the step's argmax
        assert torch.equal(r["tokens"], r["greedy"])
    head, meta = MtpHead.load(str(out))
    assert meta["format"] == FORMAT and meta["base_fingerprint"] == base_fingerprint(native_backend)
    assert head.hidden == 64 and len(head.vocab) == 256
    drafter = MtpDrafter(head, native_backend.model.embedding)
    drafts = drafter.propose_from(torch.randn(576), 100, 3)
    assert len(drafts) == 3 and set(drafts) <= set(head.vocab.tolist())
    slow = MtpDrafter(head, native_backend.model.embedding, fast=False)  # the fp32 reference path drafts too
    assert len(slow.propose_from(torch.randn(576), 100, 9)) == head.depth  # never beyond the trained depth
    assert rc == 0 and main(["train-mtp", "--data", str(data), "--epochs", "0"]) == 0  # cached answers reused


def test_train_mtp_curve_measures_each_data_size_on_mt_bench_and_writes_the_last_head(tmp_path, native_backend):
    import json

    out, fig = tmp_path / "heads.safetensors", tmp_path / "curve.json"
    rc = main(["train-mtp", "--prompt-set", "large", "--prompts", "4", "--max-tokens", "12", "--epochs", "1",
               "--hidden", "64", "--draft-vocab", "256", "--data", str(tmp_path / "shards"), "--out", str(out),
               "--json", str(fig), "--curve", "2", "--mt-bench", "2", "--mt-bench-cache", str(tmp_path / "mt.pt")])
    d = json.loads(fig.read_text())
    assert rc == 0 and d["arch"] == "mlp" and d["mt_bench_answers"] == 2 and d["hidden"] == 64
    assert [c["prompts"] for c in d["curve"]] == [2, 4]
    assert d["curve"][0]["train_answer_tokens"] < d["curve"][1]["train_answer_tokens"] == d["generation"]["answer_tokens"]
    gen = d["generation"]
    assert gen["answers"] == 8 and gen["seconds"] > 0
    assert abs(gen["tokens_per_s"] - gen["answer_tokens"] / gen["seconds"]) < 1e-6
    for c in d["curve"]:  # tokens per verification recomputed from the chain accuracy
        acc = c["chain_accuracy"]
        assert len(acc) == 4 and all(0 <= a <= 1 for a in acc) and c["train_seconds"] >= 0
        assert abs(c["expected_accepted_k3"] - expected_accepted(acc, 3)) < 1e-9
    head, meta = MtpHead.load(str(out))  # the last point's head, its MT-Bench figures in the metadata
    training = json.loads(meta["training"])
    assert head.hidden == training["hidden"] == 64
    assert training["mt_bench_chain_accuracy"] == [round(a, 4) for a in d["curve"][-1]["chain_accuracy"]]
    # the replayed verification recomputed from the written head and the cached MT-Bench answers
    from edge_cli.mtp_eval import drafter_walk

    walked = drafter_walk(MtpDrafter(head, native_backend.model.embedding), torch.load(tmp_path / "mt.pt"), 3, 128)
    assert d["curve"][-1]["mean_accepted_k3"] == walked["mean_accepted"] >= 1.0
    assert d["curve"][-1]["acceptance_per_position"] == walked["acceptance_per_position"]
    assert training["mt_bench_tokens_per_verification_k3"] == round(walked["mean_accepted"], 4)


def test_heads_of_another_model_are_not_found(tmp_path, native_backend, monkeypatch):
    import edge_runtime.spec.mtp as mtp

    head = MtpHead(576, 32, torch.arange(64))
    head.save(str(tmp_path / "other.safetensors"), "someone-else:576x30:49152")
    monkeypatch.setattr(mtp, "HEADS_DIR", str(tmp_path))
    assert find_heads(native_backend) is None
    head.save(str(tmp_path / "mine.safetensors"), base_fingerprint(native_backend))
    assert find_heads(native_backend).endswith("mine.safetensors")


def test_a_file_that_is_not_an_mtp_head_is_refused(tmp_path):
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(tmp_path / "x.safetensors"))
    with pytest.raises(ValueError, match="is not a head file of format edge-runtime-mtp/1"):
        MtpHead.load(str(tmp_path / "x.safetensors"))


def test_expected_tokens_per_step():
    assert expected_accepted([1.0, 1.0, 1.0, 1.0], 3) == 4.0
    assert expected_accepted([0.5, 0.5, 0.5], 3) == pytest.approx(1.875)
    assert expected_accepted([0.0, 1.0], 2) == 1.0


def test_shipped_heads_match_the_default_model(native_backend):
    path = find_heads(native_backend)
    assert path is not None, "edge_runtime/data/mtp ships heads for the default model"
    head, meta = MtpHead.load(path)
    import os

    assert os.path.getsize(path) <= 20 * 1024 * 1024
    assert native_backend.model.cfg.dim == head.dim


def test_heads_with_taps_save_load_and_draft_from_the_models_features(tmp_path, native_backend):
    head = MtpHead(576, 32, torch.arange(64), taps=(3, 20))
    torch.nn.init.normal_(head.w_f.weight, std=0.02)  # not the identity it starts as
    head.save(str(tmp_path / "t.safetensors"), base_fingerprint(native_backend))
    loaded, meta = MtpHead.load(str(tmp_path / "t.safetensors"))
    assert meta["taps"] == "3,20" and loaded.taps == (3, 20)
    h, e = torch.randn(2, 3 * 576), torch.randn(2, 576)
    assert torch.allclose(loaded(h, e), head(h, e), atol=1e-2)  # fp16 weights in the file
    assert loaded(h, e).shape == (2, 576) and loaded(loaded(h, e), e).shape == (2, 576)  # steps after the first
    fast = MtpDrafter(loaded, native_backend.model.embedding)
    slow = MtpDrafter(loaded, native_backend.model.embedding, fast=False)
    assert fast.fast is not None
    a, b = fast.head_step(h[:1], [100]), slow.head_step(h[:1], [100])  # the Q8 path fuses the taps too
    assert torch.nn.functional.cosine_similarity(a[1], b[1]).item() > 0.99
    assert len(fast.propose_from(h[0], 100, 3)) == 3
    with pytest.raises(ValueError, match="taps"):  # the final state alone: the model is not reporting the taps
        fast.propose_from(torch.randn(576), 100, 3)


def test_soft_loss_is_the_cross_entropy_against_the_models_own_distribution():
    from edge_cli.train_mtp import flatten, next_states, soft_loss

    torch.manual_seed(0)
    recs = [{"tokens": torch.arange(n), "hidden": torch.randn(n, 8).half()} for n in (5, 1, 3)]
    states, starts = flatten(recs)
    idx = next_states(recs, 2, starts)
    assert states.shape == (9, 8) and starts == [0, 5, 6]
    assert idx.tolist() == [[1, 2], [2, 3], [3, 4], [4, -1], [7, 8], [8, -1]]
    assert torch.equal(states[7], recs[2]["hidden"][1])
    rows, logits, w = torch.randn(6, 8), torch.randn(6, 2, 6), torch.tensor([1.0, 0.8])
    want = 0.0
    for j in range(2):
        ok = idx[:, j] >= 0
        p = torch.softmax(states[idx[ok, j]].float() @ rows.T, -1)
        want += w[j] * torch.nn.functional.cross_entropy(logits[ok, j], p)
    assert torch.allclose(soft_loss(logits, states, idx, rows, w), want)


@pytest.mark.parametrize("args, message", [
    (["--arch", "attention", "--taps", "20"], "--taps applies to --prompt-set large, chat or written"),  # the small set
    (["--taps", "20"], "--taps applies to --prompt-set large, chat or written"),
    (["--prompt-set", "large", "--taps", "30"], "--taps must be layers 0..29"),
    (["--window", "8"], "--window (8) is the attention head's"),  # the MLP heads have no windows
    (["--arch", "attention", "--window", "8", "--answers-per-step", "2"], "without --answers-per-step"),
    (["--shards", "3"], "--shards applies to --prompt-set large"),  # the small set is one file
    (["--prompt-set", "large", "--shards", "0"], "must be at least 1"),
])
def test_train_mtp_refuses_taps_and_losses_that_do_not_apply(args, message, capsys, tmp_path):
    assert main(["train-mtp", "--epochs", "0", "--data", str(tmp_path / "d")] + args) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("integer", [False, True])
@pytest.mark.parametrize("taps", [(), (20, 26)])
def test_the_one_call_head_step_equals_the_per_gemv_path(native_backend, taps, integer):
    """Q8Head.step (kernels/cpu_decode.c: mtp_head_step, the whole draft step in one parallel region) computes
    what Q8Head's separate GEMV calls and torch norms compute: the same Q8_0 GEMVs, norms that differ only in
    float rounding, so states and logits agree closely and the chosen drafts agree; for 1 and 3 rows, on 1
    and 2 threads, with and without fused taps. Drafts only propose, so this closeness (not bit-equality)
    is all losslessness needs. Both arithmetics: the fp32 GEMVs on Q8_0 rows, and (x86) the integer kernels on
    their packed layout, the default where it exists."""
    from edge_runtime.spec.mtp import Q8Head
    from kernels import cpu_gemv, cpu_qgemm

    if integer and not (cpu_qgemm.available() and cpu_qgemm.packed_supported("q8_0")):
        pytest.skip("no packed integer kernels on this CPU")

    torch.manual_seed(0)
    head = MtpHead(576, 1536, torch.arange(0, 8192, 2), taps=taps)
    for p in head.parameters():
        torch.nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1 if p.dim() == 1 else 0.03)
    drafter = MtpDrafter(head, native_backend.model.embedding)
    assert drafter.fast.integer == (cpu_qgemm.available() and cpu_qgemm.packed_supported("q8_0"))
    fast = Q8Head(head, drafter.head_rows, integer=integer)
    old = cpu_gemv.threads()
    try:
        for threads in (1, 2):
            cpu_gemv.set_num_threads(threads)
            for f in (1, 3):
                h = torch.randn(f, (1 + len(taps)) * 576) * 3
                e = native_backend.model.embedding(torch.tensor([100, 2000, 30000][:f])).reshape(f, 576).float()
                state, logits = fast.step(h, e)
                ref_state = fast(h, e)
                ref_logits = fast.logits(ref_state)
                assert torch.allclose(state, ref_state, rtol=1e-4, atol=1e-4), (threads, f)
                assert torch.allclose(logits, ref_logits, rtol=1e-3, atol=1e-3), (threads, f)
                assert logits.argmax(-1).tolist() == ref_logits.argmax(-1).tolist()
                with torch.inference_mode():  # and the fp32 head itself, to its Q8_0 weights' rounding
                    full = head(h, e) @ drafter.head_rows.T
                assert torch.nn.functional.cosine_similarity(logits, full).min() > 0.99
                # the steps after the first read the head's own state (no taps to fuse)
                state2, logits2 = fast.step(state, e)
                ref2 = fast(ref_state, e)
                assert torch.allclose(state2, ref2, rtol=1e-3, atol=1e-3), (threads, f)
                assert logits2.argmax(-1).tolist() == fast.logits(ref2).argmax(-1).tolist()
    finally:
        cpu_gemv.set_num_threads(old)
    with pytest.raises(ValueError, match="mtp_head_step rejected"):
        fast.step(torch.randn(9, (1 + len(taps)) * 576), torch.randn(9, 576))  # more rows than one call takes
    with pytest.raises(ValueError, match="the head step reads"):
        fast.step(torch.randn(1, 2 * 576 + 32), torch.randn(1, 576))


def test_a_drafts_embedding_is_read_from_the_draft_vocabulary_rows(native_backend):
    """head_step takes a draft token's embedding from head_rows (the draft vocabulary's rows of the model's
    embedding, computed once) instead of a lookup: the same values, so the same step bit for bit; a token
    outside the draft vocabulary (the verified token a chain starts from) still goes through the lookup."""
    drafter = MtpDrafter(MtpHead.load(find_heads(native_backend))[0], native_backend.model.embedding)  # taps unset
    width = (1 + len(drafter.head.taps)) * drafter.head.dim
    outside = next(t for t in range(1000, 49152) if t not in drafter.row_of)
    for tokens in ([drafter.vocab[5]], [drafter.vocab[7], drafter.vocab[4000]], [drafter.vocab[3], outside]):
        assert torch.equal(drafter.embed(torch.tensor(tokens)).reshape(len(tokens), -1).float(),
                           drafter.head_rows[[drafter.row_of.get(t, 0) for t in tokens]]) == (outside not in tokens)
        h = torch.randn(len(tokens), width)
        fast = drafter.head_step(h, tokens)
        row_of, drafter.row_of = drafter.row_of, {}
        try:
            looked_up = drafter.head_step(h, tokens)
        finally:
            drafter.row_of = row_of
        assert torch.equal(fast[0], looked_up[0]) and torch.equal(fast[1], looked_up[1])


@pytest.mark.parametrize("qtype, ratio, err", [("q8_0", 34, 0.02), ("q4_0", 18, 0.2), ("q4_1", 20, 0.15)])
def test_a_draft_matrix_in_4_bit_blocks_holds_fewer_bytes_and_stays_near_its_fp32_weights(qtype, ratio, err):
    """Q8Linear's `qtype` (scripts/attn_head_q4.py measures the attention head with each): the blocks hold
    `ratio` bytes a 32-weight block (before any repacking) and x @ w.T stays within `err` of fp32, relative."""
    from kernels import cpu_gemv

    from edge_runtime.spec.mtp import Q8Linear

    if not cpu_gemv.available():
        pytest.skip("C kernels unavailable here")
    torch.manual_seed(0)
    w, x = torch.randn(96, 128), torch.randn(3, 128)
    raw = Q8Linear(w, qtype=qtype, integer=False)
    assert raw.blocks.numel() == 96 * 128 // 32 * ratio and raw.kind == {"q8_0": 8, "q4_0": 0, "q4_1": 1}[qtype]
    want = x @ w.T
    for lin in (raw, Q8Linear(w, qtype=qtype)):  # the fp32 GEMVs and, where they run, the integer kernels
        rel = float((lin(x) - want).norm() / want.norm())
        assert 0 < rel < err, (qtype, lin.integer, rel)
