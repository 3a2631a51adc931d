"""How many drafts each running sequence carries in the next engine step.

The engine verifies drafts as extra rows of its batched decode step (engine/batch_engine.py): a
sequence with k drafts adds k rows, each computed exactly as a one-token step. Rows are not free:
a step of R rows costs t(R) (`StepCost`, measured on the engine's own decode calls for the number of
sequences they carried, a prior until then), and t(R) grows faster once the rows stop sharing the weight stream (on a 2-core AVX-512
CPU: t(4)/t(1) = 1.3, t(8)/t(1) = 2.3, t(16)/t(1) = 4.3). A sequence whose drafts are accepted at
rate a turns k drafts into 1 + a + ... + a^k tokens in expectation (`Acceptance`).

`DraftPlanner.plan` picks each sequence's k to maximize the step's expected tokens per second:
from no drafts at all it adds one draft at a time where it gains most (the next draft of sequence
j is worth a_j^(k_j + 1) tokens for a chain; for a chain its drafter sized by its own confidence,
`Confidence`, the product of its drafts' probabilities; `TreeGain.marginal` for a draft tree), and
keeps the best point of that path. So drafting shrinks as the batch fills (each extra row costs
more of a fuller step) and stops where it does not pay; a sequence left without drafts for
`probe_every` steps per row of the step gets one anyway, so its acceptance estimate can recover
(about one probe row per `probe_every` steps in all). It knows nothing about models, tokens or the
KV cache.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class Acceptance:
    """One sequence's running per-draft acceptance rate and how long it went without drafts."""
    alpha: float = 0.5
    decay: float = 0.9
    idle: int = 0
    step_seconds: float = 0.0  # what proposing one draft costs (the MTP heads' step; prompt lookup: 0)

    def observe(self, proposed: int, accepted: int) -> None:
        """One verification: the first `accepted` of `proposed` drafts were taken."""
        if proposed:
            # each position up to the first rejection is one Bernoulli trial of the acceptance rate
            trials = accepted + (accepted < proposed)
            w = self.decay ** trials
            self.alpha = w * self.alpha + (1 - w) * accepted / trials

    def marginal(self, k: int) -> float:
        """Expected tokens the (k + 1)-th draft adds: all k + 1 must be accepted."""
        return self.alpha ** (k + 1)

    def draft_cost(self, k: int) -> float:
        """Seconds proposing k drafts takes."""
        return self.step_seconds * k

    def expected_tokens(self, k: int) -> float:
        a = self.alpha
        return float(k + 1) if a >= 1.0 else (1.0 - a ** (k + 1)) / (1.0 - a)


@dataclass(slots=True)
class Confidence:
    """A chain already drafted, sized by its drafter's own probabilities (the attention head's are calibrated:
    the share of its drafts accepted, given the drafts before them were, is their probability within a few
    points; docs/speculative.md): draft j + 1 adds p_1 ... p_(j+1) tokens in expectation, and its head steps
    are spent already."""
    probs: list[float]
    idle: int = 0

    def marginal(self, k: int) -> float:
        out = 1.0
        for p in self.probs[:k + 1]:
            out *= p
        return out if k < len(self.probs) else 0.0

    def draft_cost(self, k: int) -> float:
        return 0.0


class StepCost:
    """t(R): seconds of a decode call of R rows, a running average per R as steps are measured, and per
    (sequences, R): a token's drafts share their sequence's attention reads (kernels/cpu_decode.c), so R
    rows of one sequence cost less than R rows of R sequences, and the planner asks for the step it is
    about to make. A (sequences, R) with no measurement of that many sequences falls back to t(R).

    Unmeasured row counts are interpolated between measured neighbours, or extrapolated from the
    nearest measured one along the prior shape t(R) ~ 1 + slope (R - 1)."""

    def __init__(self, max_rows: int, slope: float = 0.15, weight: float = 0.2):
        self.max_rows, self.slope, self.weight = max_rows, slope, weight
        self.seconds: dict[int, float] = {}
        self.by_sequences: dict[int, dict[int, float]] = {}

    def _prior(self, rows: int) -> float:
        return 1.0 + self.slope * (rows - 1)

    def _average(self, table: dict[int, float], rows: int, seconds: float) -> None:
        old = table.get(rows)
        table[rows] = seconds if old is None else (1 - self.weight) * old + self.weight * seconds

    def observe(self, rows: int, seconds: float, sequences: int | None = None) -> None:
        self._average(self.seconds, rows, seconds)
        if sequences:
            self._average(self.by_sequences.setdefault(sequences, {}), rows, seconds)

    def _estimate(self, table: dict[int, float], rows: int) -> float:
        if rows in table:
            return table[rows]
        below = max((r for r in table if r < rows), default=None)
        above = min((r for r in table if r > rows), default=None)
        if below is not None and above is not None:
            f = (rows - below) / (above - below)
            return (1 - f) * table[below] + f * table[above]
        near = below if below is not None else above
        if near is None:
            return self._prior(rows)
        return table[near] * self._prior(rows) / self._prior(near)

    def __call__(self, rows: int, sequences: int | None = None) -> float:
        table = self.by_sequences.get(sequences) if sequences else None
        return self._estimate(table if table else self.seconds, rows)


class DraftPlanner:
    def __init__(self, max_rows: int, k_max: int = 7, probe_every: int = 16):
        self.cost = StepCost(max_rows)
        self.max_rows, self.k_max, self.probe_every = max_rows, k_max, probe_every

    def floor(self, sequences: int, step_seconds: float) -> float:
        """The expected tokens below which a draft cannot pay in a step of `sequences` decode rows: adding its row
        (and the head step that made it) must raise the step's tokens per second, so its gain must exceed
        the step's rate times what the row costs. A chain drafted by its own confidence stops there. Never below
        0: measured costs can dip where a row is added (noise), and no draft is worth less than nothing."""
        base = self.cost(sequences, sequences)
        return max(0.0, sequences * (self.cost(sequences + 1, sequences) - base + step_seconds) / base)

    def plan(self, acceptances: list, limits: list[int], other_rows: int = 0) -> list[int]:
        """Drafts per sequence (k_j <= limits[j], the drafts its drafter could offer within its
        budget). `other_rows`: decode rows of sequences that cannot draft this step."""
        n = len(acceptances)
        limits = [max(0, min(limit, self.k_max)) for limit in limits]
        k = [0] * n
        rows = sequences = n + other_rows
        tokens, drafting = float(rows), 0.0  # drafting: seconds the proposals cost
        best, best_rate = list(k), tokens / self.cost(rows, sequences)
        while rows < self.max_rows:
            gains = [acceptances[j].marginal(k[j]) if k[j] < limits[j] else -1.0 for j in range(n)]
            j = max(range(n), key=gains.__getitem__, default=None)
            if j is None or gains[j] <= 0.0:
                break
            drafting += acceptances[j].draft_cost(k[j] + 1) - acceptances[j].draft_cost(k[j])
            k[j] += 1
            rows += 1
            tokens += gains[j]
            rate = tokens / (self.cost(rows, sequences) + drafting)
            if rate > best_rate * 1.02:  # a marginal gain is not worth the risk of a noisy estimate
                best, best_rate = list(k), rate
        rows = n + other_rows + sum(best)
        every = self.probe_every * rows  # about one probe row per probe_every steps, however full the batch
        for j, acc in enumerate(acceptances):
            if best[j] or not limits[j]:
                acc.idle = 0
                continue
            acc.idle += 1
            if acc.idle >= every and rows < self.max_rows:
                acc.idle, best[j] = 0, 1  # a probe: the estimate can recover
                rows += 1
        return best
