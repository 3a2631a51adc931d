"""The attention draft head: its chains see no future position, and training moves its drafts."""
import torch

import pytest

from edge_cli.train_attn import batch_of, chain_accuracy, piece_batch, train_attention, windows
from edge_runtime.spec.attn_head import AttnDraftHead
from edge_runtime.spec.mtp import base_fingerprint


def _head(steps=4, taps=(), layers=1) -> AttnDraftHead:
    torch.manual_seed(0)
    head = AttnDraftHead(64, 4, 16, 96, torch.arange(50), 1e-5, 10000.0, steps, taps, layers)
    for w in [w for lay in head.layers for w in (lay.w_o, lay.w_down)]:  # zero at init: make each layer matter
        torch.nn.init.normal_(w.weight, std=0.2)
    if taps:  # the identity at init: make the tapped layers matter
        torch.nn.init.normal_(head.w_f.weight, std=0.2)
    return head


def _records(lengths, vocab=50, dim=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"hidden": torch.randn(n, dim, generator=g).half(), "tokens": torch.randint(0, vocab, (n,), generator=g),
             "greedy": torch.randint(0, vocab, (n,), generator=g)} for n in lengths]


@pytest.mark.parametrize("layers", [1, 2])
def test_a_chain_started_at_t_sees_only_positions_up_to_t_and_its_own_steps(layers):
    head, steps = _head(layers=layers), 4
    emb_table = torch.randn(50, 64)
    recs = _records([7, 12, 4])
    h, emb, valid, _ = batch_of(recs, emb_table, torch.arange(50), steps)
    with torch.no_grad():
        whole = head.chain(h, emb, valid, steps)
        for b, r in enumerate(recs):
            n = len(r["tokens"])
            for t in range(n):  # the same chain with everything after t cut off (and other records' padding)
                cut = head.chain(h[b:b + 1, :t + 1], emb[b:b + 1, :t + steps], valid[b:b + 1, :t + 1], steps)
                for s in range(steps):
                    assert torch.allclose(whole[s][b, t], cut[s][0, t], atol=1e-5), (b, t, s)


@pytest.mark.parametrize("layers", [1, 2])
def test_chains_started_at_chosen_positions_are_the_whole_answers_chains_there(layers):
    """Training on windows (`qpos`) computes, for each start, what the chain over the whole answer computes there:
    the same keys (every real position up to the start; with two layers the second's from the first's output
    at every position), with the tapped layers' features fused."""
    head, steps = _head(taps=(3, 5), layers=layers), 3
    emb_table = torch.randn(50, 64)
    recs = _records([9, 14, 5], dim=3 * 64)
    h, emb, valid, _ = batch_of(recs, emb_table, torch.arange(50), steps)
    qpos = torch.tensor([[2, 3, 8], [0, 13, 6], [4, 1, 1]])
    with torch.no_grad():
        whole = head.chain(h, emb, valid, steps)
        some = head.chain(h, emb, valid, steps, qpos)
    for s in range(steps):
        want = whole[s].gather(1, qpos[..., None].expand(-1, -1, 64))
        assert torch.allclose(some[s], want, atol=1e-5), s
    assert not torch.allclose(whole[0], head.chain(h[..., :64], emb, valid, steps)[0])  # the taps are read


def test_a_two_layer_head_saves_and_loads_but_the_drafter_refuses_it(tmp_path):
    """The file says how many layers; the engine's drafter runs one-layer heads only and says so."""
    from edge_runtime.spec.attn_drafter import AttnDrafter

    head = _head(layers=2)
    head.save(str(tmp_path / "h.safetensors"), "fp")
    back, meta = AttnDraftHead.load(str(tmp_path / "h.safetensors"))
    assert meta["layers"] == "2" and len(back.layers) == 2
    h, emb, valid = torch.randn(1, 6, 64), torch.randn(1, 9, 64), torch.ones(1, 6, dtype=torch.bool)
    with torch.no_grad():
        assert all(torch.allclose(a, b, atol=1e-2) for a, b in zip(head.chain(h, emb, valid, 4),
                                                                   back.chain(h, emb, valid, 4)))  # fp16 weights
    with pytest.raises(ValueError, match="2 decoder layers"):
        AttnDrafter(back, lambda ids: torch.randn(len(ids), 64))
    _head().save(str(tmp_path / "one.safetensors"), "fp")
    assert "layers" not in AttnDraftHead.load(str(tmp_path / "one.safetensors"))[1]  # one layer: the format as before


def test_windows_tile_every_start_once_with_their_keys_and_targets():
    recs = _records([7, 12, 3], seed=3)
    pieces = windows(recs, 4)
    assert pieces == [(0, 0, 4), (0, 4, 2), (1, 0, 4), (1, 4, 4), (1, 8, 3), (2, 0, 2)]
    assert windows(recs, None) == [(0, 0, 6), (1, 0, 11), (2, 0, 2)]
    starts, flat = [0, 7, 19], torch.cat([r["hidden"] for r in recs])
    index = torch.arange(50)
    emb_table = torch.randn(50, 64)
    h, emb, valid, qpos, rows = piece_batch(pieces[3:5], recs, starts, flat, emb_table, index, 3, "soft")
    assert h.shape[1] == 11 and valid[0].sum() == 8 and valid[1].sum() == 11  # keys: the answer up to the last start
    assert torch.equal(h[0, :8], recs[1]["hidden"][:8].float()) and (h[0, 8:] == 0).all()
    assert qpos.tolist() == [[4, 5, 6, 7], [8, 9, 10, 10]]  # a short piece repeats its last start, without targets
    assert torch.equal(emb[1, :12], emb_table[recs[1]["tokens"]]) and (emb[1, 12:] == 0).all()
    # soft: the flat row of the final state at t + s + 1 (-1 past the answer's end and for the repeated start)
    assert rows[1].tolist() == [[7 + 9, 7 + 10, 7 + 11], [7 + 10, 7 + 11, -1], [7 + 11, -1, -1], [-1, -1, -1]]
    _, _, _, _, tgt = piece_batch(pieces[5:], recs, starts, flat, emb_table, index, 3, "hard")
    g = recs[2]["greedy"].tolist()
    assert tgt[0].tolist() == [[g[1], g[2], -100], [g[2], -100, -100]]


class _Backend:
    """What `train_attention` reads of a backend, for a toy model: its config and its tied embeddings."""

    def __init__(self, emb_table):
        from types import SimpleNamespace

        cfg = SimpleNamespace(dim=64, num_heads=4, head_dim=16, vocab_size=len(emb_table), norm_eps=1e-5)
        self.model = SimpleNamespace(cfg=cfg, embedding=lambda ids: emb_table[ids])


@pytest.mark.parametrize("loss, window", [("soft", 4), ("hard", None)])
def test_training_on_windows_or_whole_answers_learns_a_copy_rule(loss, window):
    """Answers where the model's argmax at i + 1 is token i (and its final state there says so): a chain that
    learns it drafts at every depth; held-out accuracy must rise from chance, with either loss and batching."""
    torch.manual_seed(0)
    emb_table = torch.randn(50, 64)
    recs = _records([20] * 40, seed=2)
    for r in recs:
        r["greedy"] = torch.cat([r["greedy"][:1], r["tokens"][:-1]])
        r["hidden"] = 8 * emb_table[r["greedy"]]  # the state that chose a token is sure of it (the soft targets)
    head, report = train_attention({"records": recs}, _Backend(emb_table), steps=3, hidden=96, size=50, epochs=30,
                                   window=window, answers_per_step=None if window else 4, lr=1e-2, loss=loss,
                                   progress=lambda *_: None)
    first, last = report["epochs"][0]["held_out"], report["epochs"][report["best_epoch"] - 1]["held_out"]
    assert last[0] > 0.9 and last[1] > 0.8 and last[0] > first[0], report["epochs"]
    assert report["window"] == window and report["batch"] == (64 if window else 4) and report["loss"] == loss


def test_a_killed_training_resumes_from_its_checkpoint_to_the_same_head(tmp_path, monkeypatch):
    """A run stopped mid-epoch (here: its batch builder raises, as a kill would stop it) and run again with the
    same checkpoint ends with exactly the head and figures of a run that was never stopped; a checkpoint made
    with other settings is refused by name."""
    import edge_cli.train_attn as ta
    from edge_runtime.errors import EdgeRuntimeError

    emb_table = torch.randn(50, 64, generator=torch.Generator().manual_seed(0))
    recs = _records([20] * 24, seed=2)
    for r in recs:
        r["greedy"] = torch.cat([r["greedy"][:1], r["tokens"][:-1]])
        r["hidden"] = 8 * emb_table[r["greedy"]]
    kw = dict(steps=3, hidden=96, size=50, epochs=3, window=4, lr=1e-2, progress=lambda *_: None)
    through = str(tmp_path / "through.pt")  # (its last epoch's end: the final weights, not only the best epoch's)
    whole, report = train_attention({"records": recs}, _Backend(emb_table), checkpoint=through, **kw)
    path, calls, real = str(tmp_path / "ckpt.pt"), [0], ta.piece_batch

    def killed(*a, **k):
        calls[0] += a[-1] == "soft"  # the training's batches (the held-out scoring's are "hard")
        if calls[0] == 4:  # the second epoch's second step (115 pieces, 64 a step)
            raise KeyboardInterrupt
        return real(*a, **k)

    monkeypatch.setattr(ta, "piece_batch", killed)
    with pytest.raises(KeyboardInterrupt):
        train_attention({"records": recs}, _Backend(emb_table), checkpoint=path, checkpoint_every=0, **kw)
    monkeypatch.setattr(ta, "piece_batch", real)
    state = torch.load(path, weights_only=False)
    assert (state["epoch"], state["step"]) == (1, 64) and len(state["report"]["epochs"]) == 1
    said: list[str] = []
    again, report2 = train_attention({"records": recs}, _Backend(emb_table), checkpoint=path, checkpoint_every=0,
                                     **{**kw, "progress": said.append})
    assert any("resumed" in m and "epoch 2, step 1" in m for m in said), said
    assert all(torch.equal(a, b) for a, b in zip(whole.state_dict().values(), again.state_dict().values()))
    last, last2 = torch.load(through, weights_only=False), torch.load(path, weights_only=False)
    assert last2["epoch"] == 3 and all(torch.equal(last["head"][k], last2["head"][k]) for k in last["head"])
    assert [e["held_out"] for e in report["epochs"]] == [e["held_out"] for e in report2["epochs"]]
    assert report["best_epoch"] == report2["best_epoch"]
    with pytest.raises(EdgeRuntimeError, match="other settings"):
        train_attention({"records": recs}, _Backend(emb_table), checkpoint=path, **{**kw, "lr": 2e-2})


def test_targets_line_up_and_training_learns_a_copy_rule():
    """Answers where each token repeats the one before: the argmax at i + 1 is token i, so a chain that learns
    it drafts at every depth; accuracy must rise from chance."""
    from edge_cli.train_attn import draft_vocab

    recs = _records([20] * 24, seed=2)
    for r in recs:
        r["greedy"] = torch.cat([r["greedy"][:1], r["tokens"][:-1]])
    vocab, index = draft_vocab(recs, 50, 50)
    h, emb, valid, tgt = batch_of(recs[:1], torch.randn(50, 64), index, 3)
    assert tgt[0, 0].tolist() == index[recs[0]["tokens"][:3]].tolist()  # start 0: the argmax at 1, 2, 3
    assert (tgt[0, 18:, 1:] == -100).all() and tgt[0, 18, 0] >= 0  # past the end: no target
    emb_table = torch.randn(50, 64)
    head = AttnDraftHead(64, 4, 16, 96, vocab, 1e-5, 10000.0, 3)
    rows = emb_table[vocab]
    before = chain_accuracy(head, recs, emb_table, rows, index, 3)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    for _ in range(150):
        h, emb, valid, tgt = batch_of(recs, emb_table, index, 3)
        outs = head.chain(h, emb, valid, 3)
        loss = sum(torch.nn.functional.cross_entropy((o @ rows.T).flatten(0, 1), tgt[..., j].flatten(),
                                                     ignore_index=-100) for j, o in enumerate(outs))
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = chain_accuracy(head, recs, emb_table, rows, index, 3)
    assert before[0] < 0.2 and after[0] > 0.9 and after[1] > 0.8, (before, after)


def test_train_mtp_arch_attention_measures_both_heads_on_mt_bench(tmp_path, native_backend):
    import json

    from edge_cli.main import main

    out, cache, heads = tmp_path / "figures.json", tmp_path / "mt.pt", tmp_path / "attn.safetensors"
    assert main(["train-mtp", "--curve", "2"]) == 2  # a curve with nowhere to write its figures: refused
    assert main(["train-mtp", "--answers-per-step", "2"]) == 2  # the MLP heads batch positions: refused
    assert main(["train-mtp", "--arch", "attention", "--answers-per-step", "0"]) == 2
    assert main(["train-mtp", "--window", "4"]) == 2  # the MLP heads have no windows: refused
    assert main(["train-mtp", "--arch", "attention", "--window", "0"]) == 2
    assert main(["train-mtp", "--arch", "attention", "--window", "4", "--answers-per-step", "2"]) == 2
    assert main(["train-mtp", "--layers", "2"]) == 2  # the MLP heads have no decoder layers: refused
    assert main(["train-mtp", "--arch", "attention", "--layers", "0"]) == 2
    assert main(["train-mtp", "--checkpoint", str(tmp_path / "c.pt")]) == 2  # the MLP heads: refused
    assert main(["train-mtp", "--arch", "attention", "--curve", "2", "--checkpoint", str(tmp_path / "c.pt")]) == 2
    rc = main(["train-mtp", "--arch", "attention", "--prompts", "4", "--max-tokens", "12", "--epochs", "1",
               "--window", "4", "--layers", "2",
               "--hidden", "64", "--draft-vocab", "256", "--data", str(tmp_path / "answers.pt"), "--json", str(out),
               "--mt-bench", "2", "--mt-bench-cache", str(cache), "--curve", "2", "--out", str(heads)])
    d = json.loads(out.read_text())
    head, meta = AttnDraftHead.load(str(heads))  # the head of the last point, with its report
    assert meta["base_fingerprint"] == base_fingerprint(native_backend) and head.hidden == 64
    assert len(head.layers) == 2 and d["attention"]["layers"] == 2
    assert json.loads(meta["training"])["chain_accuracy"] == d["attention"]["chain_accuracy"]
    assert main(["train-mtp", "--arch", "attention", "--prompts", "4", "--max-tokens", "12", "--epochs", "1",
                 "--data", str(tmp_path / "answers.pt"), "--train-prompts", "5"]) == 2  # more than the data has
    assert rc == 0 and cache.exists() and d["mt_bench_answers"] == 2 and d["train_answer_tokens"] > 0
    assert d["attention"]["window"] == 4 and d["attention"]["batch"] == 64 and d["attention"]["loss"] == "soft"
    assert [c["prompts"] for c in d["curve"]] == [2, 4] and d["curve"][-1]["chain_accuracy"] == \
        d["attention"]["chain_accuracy"] and d["curve"][0]["train_answer_tokens"] < d["train_answer_tokens"]
    for h in (d["mlp_shipped"], d["attention"], *d["curve"]):
        acc = h["chain_accuracy"]
        assert len(acc) == 4 and all(0 <= a <= 1 for a in acc)
        assert abs(h["expected_accepted_k3"] - (1 + acc[0] + acc[0] * acc[1] + acc[0] * acc[1] * acc[2])) < 1e-9
        assert 1.0 <= h["mean_accepted_k3"] <= 4.0 and len(h["acceptance_per_position"]) == 3
    from edge_cli.mtp_eval import drafter_walk  # the shipped heads' replay recomputed
    from edge_runtime.spec.mtp import MtpDrafter

    from edge_cli.train_attn import mt_bench_records

    drafter = MtpDrafter.for_backend(native_backend)  # sets the model's taps: the cached answers get them added
    walked = drafter_walk(drafter, mt_bench_records(native_backend, n=2, path=str(cache)), 3, 128)
    assert d["mlp_shipped"]["mean_accepted_k3"] == walked["mean_accepted"]
    assert d["machine"]["cpu_model"]
