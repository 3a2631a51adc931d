"""The attention head's drafter (spec/attn_drafter.py): its per-answer cache and step-by-step chains give the
drafts `AttnDraftHead.chain` computes for every start at once (what it was trained and measured with), fed
row by row as the engine feeds it; the Q8 path on the shipped head drafts what the offline replay measured."""
import math

import pytest
import torch

from edge_runtime.spec.attn_drafter import AttnDrafter
from edge_runtime.spec.attn_head import AttnDraftHead

DIM, HEADS, HEAD_DIM, VOCAB = 64, 4, 16, 100


def random_head(seed=0, taps=(1, 2)):
    torch.manual_seed(seed)
    head = AttnDraftHead(DIM, HEADS, HEAD_DIM, 96, torch.arange(0, VOCAB, 2), taps=taps)
    with torch.no_grad():  # not the identity-like start: every part of the layer matters
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    table = torch.randn(VOCAB, DIM)
    return head.eval(), table


def c_and_torch(head, table):
    """The head on its Q8 matrices twice: the C calls, and the torch steps (the reference); skips without C."""
    c, ref = (AttnDrafter(head, lambda ids: table[ids], c_step=s) for s in (True, False))
    if c.lib is None:
        pytest.skip("C kernels unavailable here")
    return c, ref


def offline_drafts(head, table, feats, tokens, t, k):
    """`chain` started at t over the answer's first t + 1 rows, its later steps fed the drafts it makes."""
    drafts = []
    with torch.no_grad():
        for s in range(k):
            emb = table[torch.tensor(tokens[:t + 1] + drafts)][None]
            emb = torch.cat([emb, torch.zeros(1, k - 1 - len(drafts), DIM)], 1)
            outs = head.chain(feats[None, :t + 1], emb, torch.ones(1, t + 1, dtype=torch.bool), s + 1)
            drafts.append(int(head.vocab[(outs[s][0, t] @ table[head.vocab].T).argmax()]))
    return drafts


def test_chains_fed_row_by_row_draft_what_the_trained_layer_computes():
    head, table = random_head()
    drafter = AttnDrafter(head, lambda ids: table[ids], fast=False)
    T = 24
    feats, tokens = torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()
    chain, fed, seen = drafter.new_chain(), 0, set()
    for t in (0, 1, 2, 5, 6, 12, 13, 14, 23):  # as verification moves on: one row or several at a time
        for j in range(fed, t + 1):
            chain.feed(feats[j], tokens[j])
        fed = t + 1
        got = chain.propose(tokens[:t + 1], 4)
        assert got == offline_drafts(head, table, feats, tokens, t, 4), t
        assert chain.n == t + 1  # the answer's keys only: the chain's own are scratch
        seen.update(got)
    assert len(seen) > 4  # the drafts depend on the context, not one constant guess
    fresh = drafter.new_chain()  # a chain fed everything at once agrees with one fed along the way
    for j in range(T):
        fresh.feed(feats[j], tokens[j])
    assert fresh.propose(tokens, 3) == chain.propose(tokens, 3)


def test_a_chain_with_no_rows_fed_drafts_nothing():
    head, table = random_head(taps=())
    drafter = AttnDrafter(head, lambda ids: table[ids], fast=False)
    assert drafter.new_chain().propose([1, 2], 3) == []
    chain = drafter.new_chain()
    chain.feed(torch.randn(DIM), 4)  # without taps the rows are the final states alone
    assert len(chain.propose([4], 3)) == 3 and chain.n == 1


def test_the_c_step_drafts_what_the_torch_path_on_the_same_q8_weights_drafts():
    """kernels/cpu_decode.c's attn_head_chain (one call: the rows into the cache, then the chain) against the
    torch steps on the same Q8 matrices: the same GEMVs, the norms and softmax to float rounding."""
    head, table = random_head(seed=3)
    c, ref = c_and_torch(head, table)
    torch.manual_seed(1)
    T = 40
    feats, tokens = torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()
    chains, fed, same, total = (c.new_chain(), ref.new_chain()), 0, 0, 0
    for t in list(range(0, 18, 3)) + [30, 39]:  # 11 rows at once before 30: two C calls
        for ch in chains:
            for j in range(fed, t + 1):
                ch.feed(feats[j], tokens[j])
        fed = t + 1
        a, b = (ch.propose(tokens[:t + 1], 4) for ch in chains)
        same, total = same + sum(x == y for x, y in zip(a, b)), total + 4
        assert chains[0].n == chains[1].n == t + 1
        assert chains[0].propose(tokens[:t + 1], 4) == a  # nothing new fed: the same chain again
    assert same >= 0.95 * total, (same, total)
    with pytest.raises(ValueError, match="attn_head_chains rejected"):
        c._c_step(chains[0], [(feats[0], 1)] * 9, 1)  # eight rows a call at most (draft() splits): refused


def test_chains_of_several_answers_in_one_call_draft_what_each_drafts_alone():
    """draft_many (the engine's call: every drafting sequence's chain in one C call, the matrices once a step for
    all of them): answers at different lengths, rows pending or none, each with its own k and a floor that stops
    some early, draft what each answer's chain drafts alone, with the same probabilities to float rounding; the
    torch path's draft_many is its chains one by one."""
    head, table = random_head(seed=3)
    c, ref = c_and_torch(head, table)
    torch.manual_seed(5)
    answers = [(torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()) for T in (3, 12, 30, 7, 19)]
    ks = [4, 2, 4, 0, 3]

    def fed(drafter, upto, chains=None):
        chains = chains or [drafter.new_chain() for _ in answers]
        for ch, (feats, tokens), t in zip(chains, answers, upto):
            for j in range(ch.n + len(ch.pending), t):
                ch.feed(feats[j], tokens[j])
        return chains

    for drafter in (c, ref):
        together, alone = fed(drafter, (1, 5, 11, 7, 19)), fed(drafter, (1, 5, 11, 7, 19))  # 11, 19: over 8 rows
        for upto in ((1, 5, 11, 7, 19), (3, 9, 11, 7, 19), (3, 12, 30, 7, 19)):  # the 3rd, 4th, 5th: nothing new fed
            fed(drafter, upto, together), fed(drafter, upto, alone)
            many = drafter.draft_many(together, ks)
            one = [drafter.draft(ch, k) for ch, k in zip(alone, ks)]
            assert [len(d) for d in many] == ks and many == one, (drafter.lib is not None, upto)
            assert [a.probs for a in together] == [pytest.approx(b.probs, abs=1e-5) for b in alone]
            assert [ch.n for ch in together] == [ch.n for ch in alone] == list(upto)
        drafter.MAX_CHAINS, calls, c_chains = 2, [], drafter._c_chains  # more answers than a call takes:
        drafter._c_chains = lambda jobs, floor=0.0: calls.append(len(jobs)) or c_chains(jobs, floor)
        assert drafter.draft_many(together, ks) == one and [ch.n for ch in together] == [3, 12, 30, 7, 19]
        assert calls == ([2, 2, 1] if drafter.lib is not None else [])  # a call for each share, the same drafts
        del drafter.MAX_CHAINS, drafter._c_chains
        floor = sorted(ch.probs[0] * ch.probs[1] for ch in together if len(ch.probs) > 1)[1] * 1.001
        many = drafter.draft_many(together, ks, floor)
        for ch, drafts, k, full in zip(together, many, ks, one):
            reached = [math.prod(ch.probs[:j + 1]) for j in range(len(ch.probs))]
            assert drafts == full[:len(drafts)] and (len(drafts) == k or reached[-1] < floor)
            assert all(r >= floor for r in reached[:-1])
        assert any(0 < len(d) < k for d, k in zip(many, ks))  # some stopped short, others went on
        fresh = drafter.new_chain()  # never fed: no position to start from, so no drafts (and no call for it)
        assert drafter.draft_many([fresh, together[0]], [2, 2]) == [[], one[0][:2]] and fresh.probs == []
    chain = c.new_chain()  # the C call reads each fed row where it lies: a row of the wrong size is refused
    chain.feed(torch.randn(2 * DIM), 3)
    with pytest.raises(ValueError, match="a fed row has 128 features; the head reads 3 x 64"):
        c.draft_many([chain], [2])
    chain.feed(torch.randn(3 * DIM, 2)[:, 0], 4)  # a strided view: copied first, the drafts those of its copy
    alone = c.new_chain()
    alone.feed(chain.pending[1][0].contiguous(), 4)
    chain.pending = chain.pending[1:]
    assert c.draft_many([chain], [3]) == c.draft_many([alone], [3])


def offline_probs(head, table, feats, tokens, t, drafts):
    """Each draft's probability under the trained layer: its softmax over the draft vocabulary, the chain forced
    along `drafts` from t."""
    out = []
    with torch.no_grad():
        for s in range(len(drafts)):
            emb = table[torch.tensor(tokens[:t + 1] + drafts[:s])][None]
            outs = head.chain(feats[None, :t + 1], emb, torch.ones(1, t + 1, dtype=torch.bool), s + 1)
            out.append(float(torch.softmax(outs[s][0, t] @ table[head.vocab].T, -1).max()))
    return out


def test_a_chain_gives_each_drafts_probability_and_stops_where_their_product_falls_below_the_floor():
    """What sizes a chain by the head's confidence (engine/drafting.py): each draft's probability under the head
    (the trained layer's softmax over the draft vocabulary), and a floor that ends the chain after the draft
    where the product of the probabilities so far drops below it; the drafts made are the first ones of the
    chain without a floor, on the torch path and on the C step alike."""
    head, table = random_head(seed=3)
    torch.manual_seed(4)
    T = 20
    feats, tokens = torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()
    fp32 = AttnDrafter(head, lambda ids: table[ids], fast=False)
    c, ref = c_and_torch(head, table)
    stops = set()
    for t in (3, 9, 19):
        chains = [d.new_chain() for d in (fp32, c, ref)]
        for ch in chains:
            for j in range(t + 1):
                ch.feed(feats[j], tokens[j])
        full = [ch.propose(tokens[:t + 1], 4) for ch in chains]
        probs = [ch.probs for ch in chains]
        want = offline_probs(head, table, feats, tokens, t, full[0])
        assert probs[0] == pytest.approx(want, abs=1e-4)  # fp32 rounding (1.05e-5 seen on a Xeon)
        assert all(0 < p <= 1 for p in probs[1] + probs[2]) and len(probs[1]) == len(probs[2]) == 4
        same = next((j for j, (a, b) in enumerate(zip(full[1], full[2])) if a != b), 4)  # Q8: the C step and torch
        assert probs[1][:same] == pytest.approx(probs[2][:same], abs=2e-3)
        for ch, drafts, p in zip(chains, full, probs):
            reached = [p[0], p[0] * p[1], p[0] * p[1] * p[2]]
            floor = reached[1] * 1.001  # the second draft's product is below it: two drafts, then stop
            got = ch.propose(tokens[:t + 1], 4, floor=floor)
            want = next(j + 1 for j, r in enumerate(reached + [0.0]) if r < floor)
            assert got == drafts[:want] and ch.probs == pytest.approx(p[:want], abs=1e-6)
            stops.add(want)
            assert ch.propose(tokens[:t + 1], 4, floor=0.0) == drafts  # no floor: the whole chain again
    assert stops & {1, 2}  # some chains stopped short


def test_a_draft_times_its_chain_apart_from_the_rows_it_takes_in():
    """The planner prices a draft step by the chain's steps alone (the rows fed go into the head's cache
    whatever k is): the C call times its two parts apart, and `chain_seconds` is the chain's."""
    head, table = random_head(seed=3)
    c, ref = c_and_torch(head, table)
    torch.manual_seed(2)
    feats, tokens = torch.randn(9, 3 * DIM), torch.randint(0, VOCAB, (9,)).tolist()
    chain = c.new_chain()
    c._c_step(chain, [(feats[j], tokens[j]) for j in range(8)], 0)  # eight rows, no chain
    rows, steps = c.seconds
    assert rows > 0 and steps < rows
    for drafter in (c, ref):
        chain = drafter.new_chain()
        for j in range(9):
            chain.feed(feats[j], tokens[j])
        assert len(chain.propose(tokens, 4)) == 4 and drafter.chain_seconds > 0
    assert c.chain_seconds == c.seconds[1]


def forced_next(head, table, feats, tokens, t, path):
    """The head's draft after the answer's first t + 1 rows and the drafts `path` (the chain forced along them)."""
    with torch.no_grad():
        emb = table[torch.tensor(tokens[:t + 1] + path)][None]
        outs = head.chain(feats[None, :t + 1], emb, torch.ones(1, t + 1, dtype=torch.bool), len(path) + 1)
        return int(head.vocab[(outs[-1][0, t] @ table[head.vocab].T).argmax()])


def test_a_tree_grown_from_a_chain_drafts_along_every_path_what_the_chain_forced_along_it_drafts():
    """--draft mtp-attn-tree: each node of a tree is the chain's step for its path (its query over the answer's
    keys and its ancestors'), so a node's likeliest child is what the trained layer drafts after that path;
    a tree one wide is the chain itself; the C path's cache grows the same trees."""
    from edge_runtime.spec.tree import TreeDrafter

    head, table = random_head(seed=5)
    drafter = AttnDrafter(head, lambda ids: table[ids], fast=False)
    trees = TreeDrafter(drafter, size=15, width=4, depth=4)
    T = 20
    feats, tokens = torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()
    chain, fed, checked = drafter.new_chain(), 0, 0
    for t in (0, 3, 4, 11, 19):
        for j in range(fed, t + 1):
            chain.feed(feats[j], tokens[j])
        fed = t + 1
        tree = trees.grow(None, tokens[t], 15, 4, head=chain)
        assert tree.size == 15 and chain.n == t + 1 and not chain.pending
        for i in range(len(tree.tokens)):
            kids = [c for c in range(i + 1, len(tree.tokens)) if tree.parents[c] == i]
            if not kids:
                continue
            path, node = [], i
            while node:
                path.insert(0, tree.tokens[node])
                node = tree.parents[node]
            assert tree.tokens[kids[0]] == forced_next(head, table, feats, tokens, t, path), (t, i)
            checked += 1
        line = TreeDrafter(drafter, size=4, width=1, depth=4).grow(None, tokens[t], 4, 4, head=chain)
        assert line.tokens[1:] == chain.propose(tokens[:t + 1], 4) and line.parents == [-1, 0, 1, 2, 3]
    assert checked >= 20


def test_the_c_tree_level_grows_what_the_torch_path_on_the_same_q8_weights_grows():
    """kernels/cpu_decode.c's attn_head_tree_level (a level of the tree in one call) against tree_step's torch
    path on the same Q8 matrices: the same states and logits to float rounding, so the same trees; a tree one
    wide drafts what the C chain drafts."""
    from edge_runtime.spec.tree import TreeDrafter

    head, table = random_head(seed=6)
    c, ref = c_and_torch(head, table)
    torch.manual_seed(4)
    T = 30
    feats, tokens = torch.randn(T, 3 * DIM), torch.randint(0, VOCAB, (T,)).tolist()
    chains, same, total = (c.new_chain(), ref.new_chain()), 0, 0
    for t in (0, 9, 10, 29):
        for ch in chains:
            for j in range(ch.n + len(ch.pending), t + 1):
                ch.feed(feats[j], tokens[j])
        starts = [d.tree_root(ch) for d, ch in zip((c, ref), chains)]
        a, b = (d.tree_step(ch, st, [tokens[t]]) for d, ch, st in zip((c, ref), chains, starts))
        for _ in range(3):  # the root's level, then three levels of the same four nodes
            assert torch.allclose(a[1], b[1], atol=1e-3, rtol=1e-3) and torch.allclose(a[0].k, b[0].k, atol=1e-4)
            kids = [int(i) for i in b[1][0].topk(4).indices] if a[0].state.shape[0] == 1 else \
                [int(i) for i in b[1].argmax(1)]
            rows = [0] * 4 if a[0].state.shape[0] == 1 else list(range(4))
            toks = [c.vocab[i] for i in kids]
            a = c.tree_step(chains[0], a[0][rows], toks)
            b = ref.tree_step(chains[1], b[0][rows], toks)
        grown = [TreeDrafter(d, size=15, width=4, depth=4).grow(None, tokens[t], 15, 4, head=ch)
                 for d, ch in zip((c, ref), chains)]
        same, total = same + sum(x == y for x, y in zip(grown[0].tokens, grown[1].tokens)), total + 16
        line = TreeDrafter(c, size=4, width=1, depth=4).grow(None, tokens[t], 4, 4, head=chains[0])
        assert line.tokens[1:] == chains[0].propose(tokens[:t + 1], 4)
        assert chains[0].n == chains[1].n == t + 1
    assert same >= 0.9 * total, (same, total)


def test_chains_on_the_fp32_gemvs_take_more_than_eight_rows_in_one_call(monkeypatch):
    """Where cpu_qgemm has no packed layout (the portable and NEON builds) the head runs cpu_gemv's fp32 GEMVs, 8
    rows a call: several answers with more than 8 rows between them still go in one call, and draft as alone."""
    from kernels import cpu_qgemm

    monkeypatch.setattr(cpu_qgemm, "packed_supported", lambda kind: False)
    head, table = random_head(seed=3)
    c, _ = c_and_torch(head, table)
    assert not c.w_in.integer
    torch.manual_seed(6)
    answers = [(torch.randn(8, 3 * DIM), torch.randint(0, VOCAB, (8,)).tolist()) for _ in range(3)]
    together, alone = [c.new_chain() for _ in answers], [c.new_chain() for _ in answers]
    for chains in (together, alone):
        for ch, (feats, tokens) in zip(chains, answers):
            for j in range(8):
                ch.feed(feats[j], tokens[j])
    many = c.draft_many(together, [3, 3, 3])  # 24 rows in one call
    assert many == [c.draft(ch, 3) for ch in alone] and all(len(d) == 3 for d in many)
