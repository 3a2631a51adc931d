"""The attention draft head: its chains see no future position, and training moves its drafts."""
import torch

from edge_cli.train_attn import batch_of, chain_accuracy
from edge_runtime.spec.attn_head import AttnDraftHead


def _head(steps=4) -> AttnDraftHead:
    torch.manual_seed(0)
    head = AttnDraftHead(64, 4, 16, 96, torch.arange(50), 1e-5, 10000.0, steps)
    for w in (head.w_o, head.w_down):  # zero at init: make the attention and the block matter
        torch.nn.init.normal_(w.weight, std=0.2)
    return head


def _records(lengths, vocab=50, dim=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [{"hidden": torch.randn(n, dim, generator=g).half(), "tokens": torch.randint(0, vocab, (n,), generator=g),
             "greedy": torch.randint(0, vocab, (n,), generator=g)} for n in lengths]


def test_a_chain_started_at_t_sees_only_positions_up_to_t_and_its_own_steps():
    head, steps = _head(), 4
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

    out, cache = tmp_path / "figures.json", tmp_path / "mt.pt"
    assert main(["train-mtp", "--arch", "attention", "--out", "x"]) == 2  # no head file to write: refused
    assert main(["train-mtp", "--curve", "2"]) == 2  # a curve with nowhere to write its figures: refused
    assert main(["train-mtp", "--answers-per-step", "2"]) == 2  # the MLP heads batch positions: refused
    assert main(["train-mtp", "--arch", "attention", "--answers-per-step", "0"]) == 2
    rc = main(["train-mtp", "--arch", "attention", "--prompts", "4", "--max-tokens", "12", "--epochs", "1",
               "--answers-per-step", "3",
               "--hidden", "64", "--draft-vocab", "256", "--data", str(tmp_path / "answers.pt"), "--json", str(out),
               "--mt-bench", "2", "--mt-bench-cache", str(cache), "--curve", "2"])
    d = json.loads(out.read_text())
    assert rc == 0 and cache.exists() and d["mt_bench_answers"] == 2 and d["train_answer_tokens"] > 0
    assert d["attention"]["batch"] == 3
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
