"""Speculative decoding end to end: lossless greedy output (n-gram and MTP, native and llama.cpp), the
sampled distribution under rejection sampling (good and deliberately bad drafters), the KV cache
afterwards, and the adaptive draft length."""
import pytest
import torch

from edge_cli.bench.spec import grounded_prompts
from edge_runtime.request import GenerationRequest, SamplingParams
from edge_runtime.engine.sampler import Sampler
from edge_runtime.spec.speculative import DraftLength, NgramProposer, Speculator

PROMPTS = grounded_prompts(5) + [
    "Explain how a hash map works.", "Write a haiku about rain.", "List the planets of the solar system.",
    "Repeat this sentence three times: the cat sat on the mat.", "Write a Python function that reverses a list.",
]


def greedy(backend, prompt, draft, max_tokens=128, k=None):
    # every run starts cold: a prefix-cache hit recomputes the prompt's tail through other kernels
    # (a separate, known difference of up to 1e-5 in the logits), and only drafting is under test here
    backend.reset_prefix_cache()
    backend.set_draft(draft, k=k)
    try:
        req = GenerationRequest(messages=[{"role": "user", "content": prompt}],
                                params=SamplingParams(temperature=0.0, max_tokens=max_tokens))
        return backend.generate(req)
    finally:
        backend.set_draft("none")


def check_cache_holds_only_the_answer(backend, res, question):
    """No rejected draft reached the prefix cache: after one cold request, the cached blocks are exactly the
    full blocks of its prompt and evaluated answer tokens (all but the last, and the last too when an
    end-of-generation token came after it), and they hold those tokens."""
    engine = backend.engine
    n = res.usage.prompt_tokens
    evaluated = len(res.token_ids) - 1 + (res.finish_reason == "stop")
    full = (n + evaluated) // engine.blocks.block_size
    assert engine.blocks.stats()["num_cached_blocks"] == full
    prompt = engine.tokenizer.encode(backend.template.render([{"role": "user", "content": question}], add_generation_prompt=True), special=True)
    assert len(prompt) == n and engine.blocks.num_cached_prefix(prompt + res.token_ids) == full * engine.blocks.block_size


def check_lossless(backend, draft, prompts, max_tokens, plain=None, k=None):
    """Every answer identical to plain decoding; drafts were both accepted and rejected along the way."""
    proposed = accepted = 0
    plain = plain or {}
    for p in prompts:
        if p not in plain:
            plain[p] = greedy(backend, p, "none", max_tokens)
        spec = greedy(backend, p, draft, max_tokens, k)
        assert spec.token_ids == plain[p].token_ids, (draft, p[:60])
        assert spec.text == plain[p].text
        d = spec.timings["draft"]
        proposed, accepted = proposed + d["proposed"], accepted + d["accepted"]
        check_cache_holds_only_the_answer(backend, spec, p)
    assert 0 < accepted < proposed, (accepted, proposed)
    return plain


@pytest.fixture(scope="module")
def plain_answers():
    return {}


def test_ngram_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers):
    check_lossless(native_backend, "ngram", PROMPTS, 128, plain_answers)


def test_mtp_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers):
    from edge_runtime.spec.mtp import find_heads

    assert find_heads(native_backend), "the trained heads ship in edge_runtime/data/mtp"
    check_lossless(native_backend, "mtp", PROMPTS, 128, plain_answers)


@pytest.mark.parametrize("size", [7, None])
def test_mtp_tree_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers, size):
    """Draft trees in the engine's steps (a fixed size of 7 drafts, and the adaptive size)."""
    check_lossless(native_backend, "mtp-tree", PROMPTS if size else PROMPTS[:4], 128, plain_answers, k=size)


@pytest.mark.parametrize("k", [3, None])
def test_mtp_attn_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers, k):
    """The attention head's chains (each answer's own key/value cache of the head), at a fixed k and at the
    adaptive length."""
    from edge_runtime.spec.attn_head import FORMAT
    from edge_runtime.spec.mtp import find_heads

    assert find_heads(native_backend, FORMAT), "the trained attention head ships in edge_runtime/data/mtp"
    check_lossless(native_backend, "mtp-attn", PROMPTS if k else PROMPTS[:4], 128, plain_answers, k=k)


@pytest.mark.parametrize("draft", ["mtp-attn-tree", "mtp-attn-ngram-tree"])
@pytest.mark.parametrize("size", [7, None])
def test_mtp_attn_tree_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers, size, draft):
    """Draft trees grown from the attention head's chains, alone and with prompt lookup's chain as a branch (a
    fixed size of 7 drafts, and the adaptive size)."""
    check_lossless(native_backend, draft, PROMPTS if size else PROMPTS[:4], 128, plain_answers, k=size)


def test_drafting_on_llama_cpp_is_refused_because_its_batches_round_differently(llama_backend):
    from edge_runtime.errors import InvalidRequestError

    llama_backend.set_draft("auto")  # the default: plain decoding there
    assert llama_backend.drafter is None and llama_backend.draft == "none"
    with pytest.raises(InvalidRequestError, match="would change its answers"):
        llama_backend.set_draft("ngram")
    with pytest.raises(InvalidRequestError, match="MTP drafting needs the native backend"):
        llama_backend.set_draft("mtp")
    with pytest.raises(InvalidRequestError, match="mtp-attn drafts in the native backend's batch engine only"):
        llama_backend.set_draft("mtp-attn")
    assert llama_backend.drafter is None


@pytest.mark.parametrize("k", [3, None])
def test_mtp_ngram_greedy_output_is_identical_to_plain_decoding(native_backend, plain_answers, k):
    """The heads with prompt lookup (what --draft auto runs), at a fixed k and at the adaptive length."""
    check_lossless(native_backend, "mtp-ngram", PROMPTS if k else PROMPTS[:4], 128, plain_answers, k=k)


def test_mtp_ngram_takes_prompt_lookup_from_two_matching_tokens_and_the_heads_otherwise(native_backend):
    from edge_runtime.spec.speculative import make_drafter

    drafter = make_drafter("mtp-ngram", native_backend)
    head = drafter.mtp.head
    hidden = torch.randn((1 + len(head.taps)) * head.dim, generator=torch.Generator().manual_seed(0))
    one = [500, 600, 700, 800, 900, 500]  # the last token occurred before: a one-token match only
    assert drafter.propose(one, 3, hidden) == drafter.mtp.propose(one, 3, hidden) != [600, 700, 800]
    assert NgramProposer().propose(one, 3) == [600, 700, 800]  # what plain prompt lookup would have drafted
    two = one + [600]  # the last two tokens occurred before: lookup's continuation
    assert drafter.propose(two, 3, hidden) == [700, 800, 900]
    assert drafter.name == "mtp-ngram" and drafter.needs_hidden


def test_kv_cache_holds_only_accepted_tokens_after_drafting(native_backend):
    res = greedy(native_backend, PROMPTS[0], "ngram", 48, k=7)  # long drafts: rejections are certain
    d = res.timings["draft"]
    assert d["proposed"] > d["accepted"]
    check_cache_holds_only_the_answer(native_backend, res, PROMPTS[0])


def test_unknown_draft_method_is_a_clear_error(native_backend):
    from edge_runtime.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError, match="unknown draft method 'eagle'"):
        native_backend.set_draft("eagle")
    assert native_backend.drafter is None


# ---- the sampled distribution --------------------------------------------------------------------------

ROOT, A = -1, -2  # the prompt C ends in a token A that was sampled but not yet evaluated


class TableRunner:
    """Logits of the real model at fixed contexts (C, then C + t for its 24 likeliest next tokens t),
    restricted to those 24 tokens so that 12,000 draws run in seconds. Speculator and Sampler drive it
    exactly as the generation loop drives the model's runner."""

    def __init__(self, rows: dict, n_ctx=10_000):
        self.rows, self.n_ctx, self.cached_ids = rows, n_ctx, [ROOT]

    def _row(self):
        return self.rows.get(tuple(self.cached_ids), torch.zeros(24))

    def step(self, t):
        self.cached_ids.append(t)
        return self._row()

    def verify(self, ts):
        out = []
        for t in ts:
            self.cached_ids.append(t)
            out.append(self._row())
        return torch.stack(out)

    def keep(self, n):
        del self.cached_ids[n:]


class FixedDrafter:
    """Proposes `drafts` for the two tokens after A, whatever happens."""
    name = "fixed"

    def __init__(self, drafts):
        self.drafts, self.fixed_k = drafts, 2

    def propose(self, history, k):
        return self.drafts[len(history) - 2:][:k]


@pytest.fixture(scope="module")
def table(native_backend):
    from edge_runtime.engine.completion import build_prompt, prompt_ids

    runner = native_backend.runner
    req = GenerationRequest(messages=[{"role": "user", "content": "Name a color."}], params=SamplingParams())
    ids = prompt_ids(runner, build_prompt(req, native_backend.template))
    first = runner.prefill(ids)
    vocab = torch.topk(first, 24).indices  # local token i <-> model token vocab[i]
    rows = {(ROOT, A): first[vocab]}
    for i, t in enumerate(vocab.tolist()):
        rows[(ROOT, A, i)] = runner.prefill(ids + [t])[vocab]
    return rows


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor) -> float:
    n = counts.sum()
    expected = probs * n
    keep = expected >= 5
    obs = torch.cat([counts[keep], counts[~keep].sum().reshape(1)])
    exp = torch.cat([expected[keep], expected[~keep].sum().reshape(1)])
    if exp[-1] < 5:  # fold a tiny remainder into the last kept cell
        obs, exp = torch.cat([obs[:-2], obs[-2:].sum().reshape(1)]), torch.cat([exp[:-2], exp[-2:].sum().reshape(1)])
    stat = float(((obs - exp) ** 2 / exp).sum())
    return float(torch.special.gammaincc(torch.tensor((len(obs) - 1) / 2.0), torch.tensor(stat / 2.0)))


def two_token_draws(rows, drafts, n, seed):
    """n two-token continuations after C, both tokens drafted (k = 2) by FixedDrafter(drafts)."""
    sampler = Sampler(SamplingParams(temperature=1.0, max_tokens=2, seed=seed))
    first, second = torch.zeros(24), torch.zeros(24, 24)
    for _ in range(n):
        runner = TableRunner(rows)
        spec = Speculator(runner, FixedDrafter(drafts))
        history = [ROOT, A]
        logits = spec.next_logits(A, history, 3)  # verifies [A, d1, d2] in one pass (3 tokens wanted)
        t1 = sampler.sample(logits, history, draft=spec.draft())
        history.append(t1)
        t2 = sampler.sample(spec.next_logits(t1, history, 2), history, draft=spec.draft())
        first[t1] += 1
        second[t1, t2] += 1
    return first, second


@pytest.mark.parametrize("drafter", ["likeliest", "deliberately_bad"])
def test_rejection_sampling_keeps_the_model_distribution(table, drafter):
    p1 = torch.softmax(table[(ROOT, A)], -1)
    top, worst = int(torch.argmax(p1)), int(torch.argmin(p1))
    if drafter == "likeliest":
        drafts = [top, int(torch.argmax(table[(ROOT, A, top)]))]
    else:  # the least likely token, then the least likely follower: nearly always rejected
        drafts = [worst, int(torch.argmin(table[(ROOT, A, worst)]))]
    first, second = two_token_draws(table, drafts, 12_000, seed=7)
    assert chi_square_p(first, p1) > 0.01
    # the second token given the commonest first one (reached by accepted and by rejected drafts alike)
    p2 = torch.softmax(table[(ROOT, A, top)], -1)
    assert second[top].sum() > 1000
    assert chi_square_p(second[top], p2) > 0.01


def test_seeded_sampling_gives_the_same_answer_with_and_without_drafting(native_backend):
    """Deterministic drafts are checked by drawing from p and comparing (the one-hot case of the rejection
    test), so the random stream is untouched: a seed gives the same answer whatever the drafts."""
    outs = {}
    for draft in ("none", "ngram", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-tree"):
        native_backend.runner.reset()
        native_backend.set_draft(draft, k=3)  # a fixed length: the adaptive one follows wall-clock costs
        try:
            req = GenerationRequest(messages=[{"role": "user", "content": PROMPTS[8]}],
                                    params=SamplingParams(temperature=0.8, top_p=0.95, max_tokens=64, seed=11))
            outs[draft] = native_backend.generate(req)
        finally:
            native_backend.set_draft("none")
    assert outs["ngram"].token_ids == outs["none"].token_ids == outs["mtp"].token_ids == outs["mtp-tree"].token_ids
    assert outs["mtp-ngram"].token_ids == outs["none"].token_ids == outs["mtp-attn"].token_ids
    assert outs["mtp-ngram"].timings["draft"]["verify_steps"] > 0 and outs["mtp-attn"].timings["draft"]["accepted"] > 0
    assert outs["mtp-tree"].timings["draft"]["verify_steps"] > 0
    tree = outs["mtp-attn-tree"]
    assert tree.token_ids == outs["none"].token_ids and tree.timings["draft"]["accepted"]
    assert outs["ngram"].timings["draft"]["accepted"] > 0


def test_chi_square_detects_a_wrong_distribution(table):
    """The test above can fail: accepting every draft (no rejection test) is caught."""
    p0 = torch.softmax(table[(ROOT, A)], -1)
    worst = int(torch.argmin(p0))
    counts = torch.multinomial(p0, 12_000, replacement=True, generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(counts, minlength=24).float()
    biased = counts.clone()
    biased[worst] += 600  # what always keeping a bad draft 5 % of the time would add
    assert chi_square_p(counts, p0) > 0.01
    assert chi_square_p(biased, p0) < 0.01


def test_general_rejection_rule_with_a_draft_distribution(table):
    """Drafts sampled from a wrong q (a flattened p): accept with min(1, p/q), else draw from max(p - q, 0)."""
    p = torch.softmax(table[(ROOT, A)], -1)
    q = torch.softmax(table[(ROOT, A)] * 0.3, -1)
    sampler = Sampler(SamplingParams(temperature=1.0, seed=3))
    g = torch.Generator().manual_seed(5)
    counts = torch.zeros(24)
    for _ in range(12_000):
        d = int(torch.multinomial(q, 1, generator=g))
        counts[sampler.sample(table[(ROOT, A)], [ROOT, A], draft=d, draft_probs=q)] += 1
    assert chi_square_p(counts, p) > 0.01


def test_drafts_are_clamped_by_tokens_wanted_and_context_left(table):
    """No draft past max_tokens (the bonus row covers the last wanted token) or past the context."""
    class Always:
        name, fixed_k = "always", 7

        def propose(self, history, k):
            return [3] * k

    runner = TableRunner(table)
    spec = Speculator(runner, Always())
    spec.next_logits(A, [ROOT, A], 3)  # 3 tokens wanted after A: 2 drafts suffice
    assert runner.cached_ids == [ROOT, A, 3, 3]
    runner = TableRunner(table, n_ctx=4)
    spec = Speculator(runner, Always())
    spec.next_logits(A, [ROOT, A], 50)  # room for one more position only
    assert runner.cached_ids == [ROOT, A, 3]
    spec.finish([ROOT, A, 5])  # the request ends: the unchecked draft leaves the cache
    assert runner.cached_ids == [ROOT, A]


# ---- the adaptive draft length --------------------------------------------------------------------------

def test_draft_length_follows_acceptance_and_cost():
    length = DraftLength(k_max=7)
    for t, c in {1: 10.0, 2: 12.0, 3: 13.0, 4: 14.0, 5: 16.0, 6: 17.0, 7: 18.0, 8: 20.0}.items():
        length.observe_cost(t, c)
    for _ in range(30):
        length.observe_acceptance(4, 4)
    high = length.choose(7)
    assert high >= 4
    assert length.choose(2) == 2  # clamped by what is still wanted
    for _ in range(60):
        length.observe_acceptance(4, 0)
    assert length.alpha < 0.1
    assert length.choose(7) == 0  # drafting does not pay: plain steps
    probes = [length.choose(7) for _ in range(32)]
    assert probes.count(1) == 2 and set(probes) == {0, 1}  # but it keeps probing
    assert DraftLength(3, fixed=True).choose(7) == 3
    with pytest.raises(ValueError):
        DraftLength(k_max=9)


def test_ngram_proposer_is_named_for_stats():
    assert NgramProposer.name == "ngram"
