"""Draft trees (spec/tree.py): tree attention gives every node the one-token step's logits after its path,
bit for bit; the accepted path moves onto consecutive positions and nothing else stays in the KV cache or
reaches the prefix cache; the tree the heads grow is well formed; sizes are scored against the answer; the
sampled distribution is kept with good and deliberately bad trees; the single-sequence loop's greedy
answers equal plain decoding's (the engine's: test_spec_decode.py and engine/test_drafting.py)."""
import pytest
import torch

from edge_runtime.engine.completion import build_prompt, prompt_ids
from edge_runtime.engine.generator import generate_stream
from edge_runtime.engine.sampler import Sampler
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.spec.tree import DraftTree, TreeDrafter, TreeGain, TreeSpeculator

from tests.edge_runtime.spec.test_spec_decode import A, ROOT, TableRunner, chi_square_p, table  # noqa: F401


def prompt(backend, text):
    req = GenerationRequest(messages=[{"role": "user", "content": text}], params=SamplingParams())
    return prompt_ids(backend.runner, build_prompt(req, backend.template))


def test_tree_rows_equal_one_token_steps_after_their_paths(native_backend):
    runner = native_backend.runner
    ids = prompt(native_backend, "Write a haiku about the sea.")

    def steps(path):  # the reference: plain one-token steps along the path
        runner.reset()
        runner.prefill(ids)
        return [runner.step(t).reshape(-1).clone() for t in path]

    runner.reset()
    first = int(torch.argmax(runner.prefill(ids)))
    greedy, rows = [first], steps([first])
    for _ in range(4):
        greedy.append(int(torch.argmax(rows[-1])))
        rows = steps(greedy)
    # the greedy path goes through the second child of the root, a wrong branch comes first
    toks = [first, 999, 5, greedy[1], 777, greedy[2], greedy[3]]
    parents = [-1, 0, 1, 0, 3, 3, 5]
    runner.reset()
    runner.prefill(ids)
    pos0 = len(runner.cached_ids)
    out = runner.verify_tree(toks, parents)
    for i in range(len(toks)):
        path, j = [], i
        while j >= 0:
            path.append(toks[j])
            j = parents[j]
        assert torch.equal(out[i], steps(path[::-1])[-1]), i
    runner.reset()
    runner.prefill(ids)
    runner.verify_tree(toks, parents)
    runner.keep_path(pos0, [0, 3, 5, 6])  # the root and three accepted drafts
    assert runner.cached_ids == ids + greedy[:4]
    assert runner.blocks.num_tokens(runner.seq) == len(ids) + 4
    nxt = runner.step(greedy[4])  # decoding goes on as if nothing else had been verified
    assert torch.equal(nxt.reshape(-1), steps(greedy[:5])[-1])
    # the rejected branch never entered the prefix cache
    assert runner.blocks.num_cached_prefix(ids + [first, 999, 5] + [0] * 32) <= len(ids)
    with pytest.raises(ValueError, match="must come before it"):
        runner.verify_tree([first, 5], [-1, 1])


@pytest.fixture(scope="module")
def tree_drafter(native_backend):
    from edge_runtime.spec.speculative import make_drafter

    return make_drafter("mtp-tree", native_backend)


def test_grown_tree_is_depth_first_ranked_and_prunes_to_trees(native_backend, tree_drafter):
    runner = native_backend.runner
    runner.reset()
    logits = runner.prefill(prompt(native_backend, "Explain how a hash map works."))
    tree = tree_drafter.grow(runner.last_hidden, int(torch.argmax(logits)), 15, 5)
    assert tree.size == 15 and tree.parents[0] == -1 and sorted(tree.ranks[1:]) == list(range(15))
    depth = [0] * len(tree.tokens)
    for i in range(1, len(tree.tokens)):
        p = tree.parents[i]
        assert 0 <= p < i and tree.ranks[p] < tree.ranks[i]  # parents first, and likelier
        depth[i] = depth[p] + 1
        assert depth[i] == depth[i - 1] + 1 or p != i - 1  # a node right after its parent is one deeper
    assert 1 < max(depth) <= 5 and any(len(c) > 1 for c in tree.children)  # deeper than one level, and branching
    for n in (1, 4, 9):
        small = tree.top(n)
        assert small.size == n and set(small.ranks[1:]) == set(range(n))
        assert all(0 <= p < i for i, p in enumerate(small.parents) if i)
    first = max(tree.children[0], key=lambda t: -tree.ranks[tree.children[0][t]])
    path = tree.follow([first, -5])
    assert path == [tree.children[0][first]]


class NextTokensHead:
    """A head whose drafts after token t are t + 1, then t + 2 (every path alike): a tree's shape is known."""
    vocab = list(range(20))

    def first_state(self, hidden):
        return torch.zeros(1, 1)

    def head_step(self, states, tokens):
        logits = torch.full((len(tokens), 20), -10.0)
        for r, t in enumerate(tokens):
            logits[r, (t + 1) % 20], logits[r, (t + 2) % 20] = 2.0, 1.0
        return torch.zeros(len(tokens), 1), logits


def test_prompt_lookups_chain_is_a_branch_ranked_first_and_merged_where_the_head_drafts_it():
    """--draft mtp-attn-ngram-tree: prompt lookup's chain (6, 9, 3 after 5) goes into the tree first, ranked
    0, 1, 2; the head's own first draft after 5 is 6 as well, so that node is the lookup's and the head's
    drafts under it (7, 8) hang off it; nothing appears twice under one parent."""
    drafter = TreeDrafter(None, size=15, width=2, depth=3)
    tree = drafter.grow(None, 5, 8, 3, head=NextTokensHead(), lookup=[6, 9, 3])
    assert tree.size == 8
    lookup = tree.follow([6, 9, 3])
    assert len(lookup) == 3 and [tree.ranks[i] for i in lookup] == [0, 1, 2]
    assert tree.top(3).tokens == [5, 6, 9, 3]  # the three best drafts: the lookup chain alone
    assert sorted(tree.children[0]) == [6, 7] and sorted(tree.children[lookup[0]]) == [7, 8, 9]
    for i, kids in enumerate(tree.children):  # a token once per parent, every node counted there
        assert len(kids) == sum(p == i for p in tree.parents)
    plain = drafter.grow(None, 5, 8, 3, head=NextTokensHead())
    assert len(plain.follow([6, 7, 8])) == 3 and len(plain.follow([6, 9])) == 1  # without lookup: no 9 after 6


def test_tree_gain_scores_every_size_against_the_answer():
    # root 10; children 11 (rank 0) and 12 (rank 1); 11 -> 13 (rank 2); 12 -> 14 (rank 3)
    tree = DraftTree([10, 11, 13, 12, 14], [-1, 0, 1, 0, 3], [-1, 0, 2, 1, 3])
    assert tree.follow([12, 14, 99]) == [3, 4] and tree.follow([11, 13]) == [1, 2] and tree.follow([7]) == []
    gain = TreeGain(4, decay=0.0)  # no memory: the last score alone
    gain.add(tree, 0, 2)
    gain.score([10, 12])  # the answer has not yet gone past the tree: kept pending
    assert gain.pending and gain.gain == [0.0, 0.5, 0.5, 0.5, 0.5]
    gain.score([10, 12, 14, 1])
    assert not gain.pending
    # size 1 holds only rank 0 (11): nothing accepted; size 2 adds 12; size 4 adds 14 under it
    assert gain.gain == [0.0, 0.0, 1.0, 1.0, 2.0]
    assert gain.marginal(1) == 1.0 and gain.marginal(2) == 0.0 and gain.expected_tokens(4) == 3.0


class TreeTableRunner(TableRunner):
    """TableRunner with tree verification: each node's row is the row after its path."""
    last_hidden = torch.zeros(1)

    def verify_tree(self, tokens, parents):
        base, rows, paths = list(self.cached_ids), [], []
        for i, t in enumerate(tokens):
            paths.append((paths[parents[i]] if i else []) + [t])
            rows.append(self.rows.get(tuple(base + paths[-1]), torch.zeros(24)))
        self.cached_ids = base + tokens
        self.hidden_rows = torch.zeros(len(tokens), 1)
        return torch.stack(rows)

    def keep_path(self, start, nodes):
        tokens = [self.cached_ids[start + n] for n in nodes]
        self.cached_ids = self.cached_ids[:start] + tokens


class FixedTree:
    """Grows the same drafts after any token: two first drafts, each with a follower."""
    name, size, depth, fixed_k = "fixed-tree", 4, 2, 4

    def __init__(self, a, b):
        self.drafts = [a[0], a[1], b[0], b[1]]

    def grow(self, hidden, token, size, depth):
        return DraftTree([token] + self.drafts, [-1, 0, 1, 0, 3], [-1, 0, 1, 2, 3])


@pytest.mark.parametrize("drafter", ["likeliest", "deliberately_bad"])
def test_tree_sampling_keeps_the_model_distribution(table, drafter):
    p1 = torch.softmax(table[(ROOT, A)], -1)
    order = torch.argsort(p1, descending=drafter == "likeliest").tolist()
    a, b = order[0], order[1]
    pick = torch.argmax if drafter == "likeliest" else torch.argmin
    tree = FixedTree((a, int(pick(table[(ROOT, A, a)]))), (b, int(pick(table[(ROOT, A, b)]))))
    sampler = Sampler(SamplingParams(temperature=1.0, max_tokens=2, seed=7))
    first, second = torch.zeros(24), torch.zeros(24, 24)
    accepted = 0
    for _ in range(12_000):
        spec = TreeSpeculator(TreeTableRunner(table), tree)
        history = [ROOT, A]
        t1 = sampler.sample(spec.next_logits(A, history, 3), history)  # verifies the whole tree in one pass
        history.append(t1)
        t2 = sampler.sample(spec.next_logits(t1, history, 2), history)
        spec.finish(history + [t2])
        accepted += spec.accepted
        first[t1] += 1
        second[t1, t2] += 1
    assert chi_square_p(first, p1) > 0.01
    top = int(torch.argmax(p1))
    p2 = torch.softmax(table[(ROOT, A, top)], -1)
    assert second[top].sum() > 1000
    assert chi_square_p(second[top], p2) > 0.01
    assert accepted == first[a] + first[b] > 0  # each first token that was a draft walked into its branch


def test_single_sequence_tree_loop_gives_plain_greedy_answers(native_backend, tree_drafter):
    """The generation loop with `TreeSpeculator` on the native runner (one sequence, no engine)."""
    runner = native_backend.runner
    accepted = verified = 0
    tree_drafter.fixed_k = 7  # a fixed size: the adaptive one follows wall-clock costs
    for text in ("Write a haiku about rain.", "List the planets of the solar system."):
        answers = []
        for drafter in (None, tree_drafter):
            runner.reset()
            req = GenerationRequest(messages=[{"role": "user", "content": text}],
                                    params=SamplingParams(temperature=0.0, max_tokens=64))
            toks, info = [], {}
            for ev in generate_stream(runner, native_backend.template, req, "native", drafter=drafter):
                toks += ev.token_ids if ev.type == "delta" else []
                info = ev.info if ev.type == "finish" else info
            answers.append(toks)
        assert answers[0] == answers[1]
        accepted, verified = accepted + info["draft"]["accepted"], verified + info["draft"]["verify_steps"]
        assert runner.cached_ids == runner.blocks._get(runner.seq).token_ids  # the cache holds the answer only
    assert verified > 0 and accepted > 0


def test_tree_flags_that_do_not_apply_are_refused(native_backend, llama_backend):
    from edge_runtime.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="1 to 15 tokens a step, not 16"):
        native_backend.set_draft("mtp-tree", k=16)
    with pytest.raises(InvalidRequestError, match="needs the native backend"):
        llama_backend.set_draft("mtp-tree")
    assert llama_backend.drafter is None
