"""Draft proposers for speculative decoding (issue 7; verification lives in the runner and generator).

`NgramProposer` is prompt lookup: when the last n tokens of the context also
occurred earlier, the tokens that followed that earlier occurrence are the
draft. It needs no model and no training, and pays on input-grounded work
(editing, summarizing, rewriting a given passage), where the answer copies
long spans of its input. Longer n-grams are tried first (more specific), the
most recent occurrence wins, and an index of n-gram -> last end position is
kept up to date incrementally, so a proposal costs O(max_n) dictionary look-ups.
"""
from __future__ import annotations

import time

from edge_runtime.spec.draft_planner import Acceptance


class NgramProposer:
    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got min_n={min_n}, max_n={max_n}")
        self.max_n, self.min_n = max_n, min_n
        self._ids: list[int] = []
        self._last: dict[tuple, int] = {}  # n-gram -> the index just after its latest occurrence (excluding the tail)
        self._indexed = 0  # positions [0, _indexed) have their n-grams in _last

    def reset(self) -> None:
        self._ids, self._last, self._indexed = [], {}, 0

    def _index_upto(self, end: int) -> None:
        """Index every n-gram ending before position `end` (so the current tail never matches itself)."""
        for pos in range(self._indexed, end):
            for n in range(self.min_n, self.max_n + 1):
                if pos + 1 >= n:
                    self._last[tuple(self._ids[pos + 1 - n:pos + 1])] = pos + 1
        self._indexed = end

    def propose(self, context: list[int], k: int) -> list[int]:
        """Up to k draft tokens continuing `context` (the whole token history: prompt and answer so far)."""
        if k < 1 or len(context) < self.min_n + 1:
            return []
        if context[:len(self._ids)] != self._ids:  # a different history: start over
            self.reset()
        self._ids = list(context)
        self._index_upto(len(context) - 1)  # n-grams ending at the last token are the query, not the index
        for n in range(min(self.max_n, len(context) - 1), self.min_n - 1, -1):
            start = self._last.get(tuple(context[-n:]))
            if start is not None:
                return context[start:start + k]
        return []


class DraftLength:
    """How many tokens to draft next: the k that maximizes expected tokens per second.

    With a per-token acceptance rate a (running average over recent drafts), k drafts yield
    1 + a + ... + a^k tokens in expectation (the accepted prefix plus the token sampled from the
    row after it), and a verification of k + 1 rows costs cost[k + 1] seconds, measured as it
    runs (a prior until then). k = 0 (a plain step) wins when drafting does not pay; it is
    clamped by the tokens still wanted and the room left in the context. While drafting is
    off, every `probe_every`-th step drafts anyway so the acceptance estimate can recover.
    """

    def __init__(self, k_max: int = 7, alpha: float = 0.5, decay: float = 0.9, probe_every: int = 16,
                 fixed: bool = False):
        if not 0 <= k_max <= 7:
            raise ValueError(f"draft length must be 0..7 (verification runs at most 8 rows), got {k_max}")
        self.k_max, self.probe_every = k_max, probe_every
        self.acceptance = Acceptance(alpha, decay)  # the running per-draft acceptance (draft_planner.py)
        self.fixed = fixed  # always k_max (clamped): for measuring acceptance at a given k
        self.cost = {t: 1.0 + 0.2 * (t - 1) for t in range(1, 9)}  # seconds, relative prior until measured
        self._measured: set[int] = set()
        self._idle = 0

    @property
    def alpha(self) -> float:
        return self.acceptance.alpha

    def expected_tokens(self, k: int) -> float:
        return self.acceptance.expected_tokens(k)

    def choose(self, limit: int) -> int:
        """The draft length for the next step, at most `limit`."""
        if self.fixed:
            return min(self.k_max, limit)
        best, best_rate = 0, 1.0 / self.cost[1]
        for k in range(1, min(self.k_max, limit) + 1):
            rate = self.expected_tokens(k) / self.cost[k + 1]
            if rate > best_rate * 1.02:  # a marginal gain is not worth the risk of a noisy estimate
                best, best_rate = k, rate
        if best == 0 and limit >= 1 and self.k_max >= 1:
            self._idle += 1
            if self._idle >= self.probe_every:
                self._idle = 0
                return 1
        else:
            self._idle = 0
        return best

    def observe_cost(self, rows: int, seconds: float) -> None:
        if not self._measured:  # the first real figure sets the scale of the relative prior
            scale = seconds / self.cost[rows]
            self.cost = {t: c * scale for t, c in self.cost.items()}
        old = self.cost[rows]
        self.cost[rows] = seconds if rows not in self._measured else 0.8 * old + 0.2 * seconds
        self._measured.add(rows)

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        """One verification: `accepted` of `proposed` drafts (a prefix) were taken."""
        self.acceptance.observe(proposed, accepted)


class Speculator:
    """Drafting for one request inside the generation loop.

    After each sampled token the loop asks `next_logits(token, history)` for the logits of the
    position after it. With drafts queued from the last verification that is free when the
    token equals the next draft (accepted); otherwise the rejected drafts leave the KV cache
    (`runner.keep`) and a new step runs: a verification of [token] + drafts (one pass over
    k + 1 rows, the drafter proposing k by `DraftLength`) or a plain one-token step. The
    loop draws each token with the next draft in hand (`draft()`): greedy takes the argmax
    as always, sampling runs the rejection test (`Sampler.sample(..., draft=d)`), so output
    is what plain decoding would give, in distribution, and bit for bit when greedy.
    """

    def __init__(self, runner, drafter, length: DraftLength | None = None):
        self.runner, self.drafter = runner, drafter
        if length is None:
            fixed_k = getattr(drafter, "fixed_k", None)
            depth = min(7, getattr(drafter, "max_depth", 7))
            length = DraftLength(min(fixed_k, depth), fixed=True) if fixed_k else DraftLength(depth)
        self.length = length
        self.queue: list[tuple[int, object, object]] = []  # (draft token, logits after it, hidden state), in order
        self.needs_hidden = getattr(drafter, "needs_hidden", False)
        self.hidden = None  # the hidden state whose logits the loop samples from (drafters that read it)
        self.steps = self.verify_steps = self.proposed = self.accepted = 0
        self.pos_proposed = [0] * 8
        self.pos_accepted = [0] * 8
        self._current: list[int] = [0, 0]  # this verification's [proposed, accepted]

    def draft(self) -> int | None:
        return self.queue[0][0] if self.queue else None

    def _close_verification(self) -> None:
        proposed, accepted = self._current
        if proposed:
            self.length.observe_acceptance(proposed, accepted)
        self._current = [0, 0]

    def next_logits(self, token: int, history: list[int], wanted: int):
        """Logits after `token` (already appended to `history`); `wanted`: tokens still to generate after it."""
        if self.needs_hidden and self.hidden is None:
            self.hidden = self.runner.last_hidden  # from the prefill
        if self.queue:
            draft, logits, hidden = self.queue.pop(0)
            if draft == token:
                self.hidden = hidden
                self.pos_accepted[self._current[1]] += 1
                self._current[1] += 1
                self.accepted += 1
                if not self.queue:
                    self._close_verification()  # every draft taken: `logits` is the bonus row
                return logits
            self.queue = []
            self.runner.keep(len(history) - 1)  # the drafts from the rejected one on leave the cache
        self._close_verification()
        room = self.runner.n_ctx - len(history) - 1  # positions left after this token
        k = self.length.choose(max(0, min(wanted - 1, room)))
        t0 = time.perf_counter()
        if not k:
            drafts = []
        elif self.needs_hidden:
            drafts = self.drafter.propose(history, k, self.hidden)[:k]
        else:
            drafts = self.drafter.propose(history, k)[:k]
        self.steps += 1
        if not drafts:
            logits = self.runner.step(token)
            self.length.observe_cost(1, time.perf_counter() - t0)
            if self.needs_hidden:
                self.hidden = self.runner.hidden_rows[0]
            return logits
        out = self.runner.verify([token] + drafts)
        self.length.observe_cost(len(drafts) + 1, time.perf_counter() - t0)
        self.verify_steps += 1
        self.proposed += len(drafts)
        for i in range(len(drafts)):
            self.pos_proposed[i] += 1
        self._current = [len(drafts), 0]
        rows = self.runner.hidden_rows if self.needs_hidden else [None] * len(out)
        self.queue = list(zip(drafts, out[1:], rows[1:]))
        self.hidden = rows[0]
        return out[0]

    def finish(self, history: list[int]) -> None:
        """The request is over: drafts never checked leave the KV cache too."""
        if self.queue:
            cached = self.runner.cached_ids
            n = len(history) - 1
            if len(cached) > n and cached[n] == history[n]:
                n += 1  # the last token was an accepted draft: its K/V is in and kept
            self.runner.keep(n)
            self.queue = []
        self._close_verification()

    def stats(self) -> dict:
        per_pos = [self.pos_accepted[i] / self.pos_proposed[i] for i in range(8) if self.pos_proposed[i]]
        return {"drafter": self.drafter.name, "steps": self.steps, "verify_steps": self.verify_steps,
                "proposed": self.proposed, "accepted": self.accepted,
                "mean_accepted": (self.accepted / self.verify_steps + 1.0) if self.verify_steps else 0.0,
                "acceptance_per_position": per_pos, "alpha": self.length.alpha,
                "pos_proposed": list(self.pos_proposed), "pos_accepted": list(self.pos_accepted)}


class LookupThenHeads:
    """`--draft mtp-ngram`: prompt lookup's continuation where the context's last two or three tokens occurred
    before, else the MTP heads' chain. A match of one token is a weaker guess than the heads' (replayed over
    the model's greedy answers to MT-Bench at k = 3: 1.91 tokens per verification when a one-token match
    wins, 2.00 from two, 1.69 for the heads alone; docs/speculative.md), and a lookup draft costs no head
    step. Deterministic drafts either way, so verification keeps output exact as for each alone."""
    name = "mtp-ngram"
    needs_hidden = True
    LOOKUP_MIN_N = 2

    def __init__(self, mtp):
        self.mtp, self.lookup = mtp, NgramProposer(min_n=self.LOOKUP_MIN_N)
        self.max_depth = 7  # lookup's spans run longer than the heads' depth; the heads stop at theirs

    def propose(self, history: list[int], k: int, hidden) -> list[int]:
        return self.lookup.propose(history, k) or self.mtp.propose(history, k, hidden)


DRAFTERS = ("auto", "none", "ngram", "mtp", "mtp-ngram", "mtp-tree", "mtp-attn", "mtp-attn-ngram", "mtp-attn-tree",
            "mtp-attn-ngram-tree")


def exact_verify(runner) -> bool:
    """Whether the runner's multi-token verification gives each row exactly its one-token step's logits
    (what lossless drafting needs). llama.cpp's does not: measured here, its batched rows differ from
    one-token rows by up to 0.9 in the logits at a few hundred tokens of context, and 6 of 12 grounded
    answers changed with n-gram drafting (`bench spec`)."""
    return hasattr(runner, "verify") and getattr(runner, "exact_verify", True)


def resolve_draft(name: str, backend) -> str:
    """`auto` on a backend without the engine's drafting (the native backend resolves it itself: the heads
    with prompt lookup, `NativeBackend.set_draft`): n-gram where the runner verifies exactly, else none."""
    if name != "auto":
        return name
    return "ngram" if exact_verify(backend.runner) else "none"


def make_drafter(name: str, backend, allow_inexact: bool = False):
    """The drafter `--draft NAME` asks for on `backend`, or None for plain decoding. `allow_inexact`
    (benchmarks only) drafts on a runner whose verification is not bit-exact, to measure what it would do."""
    from edge_runtime.errors import InvalidRequestError

    if name not in DRAFTERS:
        raise InvalidRequestError(f"unknown draft method {name!r}: choose one of {', '.join(DRAFTERS)}")
    name = resolve_draft(name, backend)
    if name == "none":
        return None
    if name.startswith("mtp-attn"):  # its per-answer cache is fed by the engine's steps (engine/drafting.py)
        raise InvalidRequestError(f"--draft {name} drafts in the native backend's batch engine only")
    if name.startswith("mtp") and getattr(backend, "model", None) is None:
        raise InvalidRequestError(f"MTP drafting needs the native backend's hidden states, not {backend.name}")
    if name == "mtp-tree" and (getattr(backend.model, "fused", None) is None or not hasattr(backend.runner,
                                                                                              "verify_tree")):
        raise InvalidRequestError("draft trees need the native backend's fused C decode step (tree attention), "
                                  "which this model or machine does not run: use --draft mtp")
    if not hasattr(backend.runner, "verify"):
        raise InvalidRequestError(f"the {backend.name} backend cannot verify drafts")
    if not exact_verify(backend.runner) and not allow_inexact:
        raise InvalidRequestError(
            f"drafting on the {backend.name} backend would change its answers: its batched evaluation rounds "
            "differently from one token at a time (use the native backend, or --draft none)")
    if name == "ngram":
        return NgramProposer()
    from edge_runtime.spec.mtp import MtpDrafter

    cached = getattr(backend, "_mtp_drafter", None)
    if cached is None:  # loading and quantizing the heads once per backend
        cached = backend._mtp_drafter = MtpDrafter.for_backend(backend)
    backend.model.taps = cached.head.taps  # the model reports the layers the heads read (set_draft may reset them)
    if name == "mtp-tree":
        from edge_runtime.spec.tree import TreeDrafter

        return TreeDrafter(cached)
    return LookupThenHeads(cached) if name == "mtp-ngram" else cached
