"""The draft planner (spec/draft_planner.py): drafts shrink as the batch fills, stop where they do not pay,
follow the measured step cost, probe a sequence left without drafts, and size a chain by its drafter's own
confidence."""
import pytest

from edge_runtime.spec.draft_planner import Acceptance, Confidence, DraftPlanner, StepCost

# t(R) in ms as measured on a 2-core AVX-512 CPU (bench decode's step curve), linear between the points
CURVE = {1: 4.4, 2: 4.7, 4: 5.8, 8: 10.4, 16: 19.1}


def planner(curve=CURVE, max_rows=16):
    p = DraftPlanner(max_rows)
    for rows, ms in curve.items():
        p.cost.observe(rows, ms / 1e3)
    return p


def expected_rate(p, accs, ks):
    return sum(a.expected_tokens(k) for a, k in zip(accs, ks)) / p.cost(len(ks) + sum(ks))


def test_drafts_shrink_as_the_batch_fills():
    p = planner()
    totals = []
    for n in (1, 2, 4, 8):
        ks = p.plan([Acceptance(alpha=0.8) for _ in range(n)], [7] * n)
        totals.append(sum(ks) / n)
    assert totals[0] >= 3 and totals == sorted(totals, reverse=True) and totals[-1] < 1


def test_no_drafts_when_they_do_not_pay():
    p = planner()
    assert p.plan([Acceptance(alpha=0.05)], [7]) == [0]
    assert p.plan([Acceptance(alpha=0.9) for _ in range(16)], [7] * 16) == [0] * 16  # no row left


def test_the_plan_beats_every_uniform_draft_length():
    """The greedy path's best point is at least as good as drafting the same k everywhere."""
    p = planner()
    accs = [Acceptance(alpha=a) for a in (0.9, 0.6, 0.3, 0.75)]
    ks = p.plan(accs, [7] * 4)
    best = expected_rate(p, accs, ks)
    for k in range(0, 4):
        assert best >= expected_rate(p, accs, [k] * 4) - 1e-9
    assert ks[0] >= ks[1] >= ks[2]  # the better a sequence's drafts, the more it carries


def test_limits_and_other_rows_are_respected():
    p = planner()
    ks = p.plan([Acceptance(alpha=0.95), Acceptance(alpha=0.95)], [2, 0], other_rows=3)
    assert ks[0] <= 2 and ks[1] == 0


def test_a_sequence_left_without_drafts_gets_a_probe():
    p = DraftPlanner(16, probe_every=4)
    acc = Acceptance(alpha=0.01)
    plans = [p.plan([acc], [5])[0] for _ in range(8)]
    assert plans == [0, 0, 0, 1, 0, 0, 0, 1]
    # with company, each sequence probes less often: about one probe row per 4 steps in all
    accs = [Acceptance(alpha=0.01) for _ in range(4)]
    probes = sum(sum(p.plan(accs, [5] * 4)) for _ in range(64))
    assert 8 <= probes <= 20


def test_step_cost_interpolates_and_extrapolates_along_the_prior():
    c = StepCost(16, slope=0.5)
    assert c(3) == pytest.approx(2.0)  # nothing measured: the prior shape
    c.observe(2, 0.004)
    c.observe(6, 0.008)
    assert c(4) == pytest.approx(0.006)
    assert c(1) == pytest.approx(0.004 * 1.0 / 1.5)
    c.observe(2, 0.006)
    assert c(2) == pytest.approx(0.8 * 0.004 + 0.2 * 0.006)


def test_step_cost_is_kept_per_number_of_sequences():
    """A token's drafts share their sequence's attention reads, so rows of one sequence are measured apart
    from rows of several; a count of sequences never measured falls back to the cost by rows alone."""
    c = StepCost(16)
    c.observe(1, 0.005, sequences=1)
    c.observe(4, 0.007, sequences=1)  # a token and 3 drafts
    c.observe(4, 0.020, sequences=4)  # four sequences at long contexts
    assert c(4, 1) == pytest.approx(0.007)
    assert c(4, 4) == pytest.approx(0.020)
    assert c(2, 1) == pytest.approx(0.005 + (0.007 - 0.005) / 3)
    assert c(4, 2) == pytest.approx(c(4)) == pytest.approx(0.8 * 0.007 + 0.2 * 0.020)
    # the planner asks for the step it would make: a lone sequence drafts on its own measurements
    p = DraftPlanner(16)
    for rows, seconds, seqs in ((1, 0.005, 1), (4, 0.0055, 1), (4, 0.020, 4), (5, 0.030, 4), (8, 0.045, 4)):
        for _ in range(5):
            p.cost.observe(rows, seconds, seqs)
    assert p.plan([Acceptance(alpha=0.8)], [5])[0] >= 3
    assert p.plan([Acceptance(alpha=0.8)] * 4, [5] * 4) == [0, 0, 0, 0]


def test_acceptance_moves_toward_what_is_observed():
    a = Acceptance(alpha=0.5)
    for _ in range(20):
        a.observe(4, 4)
    assert a.alpha > 0.95
    for _ in range(40):  # a rejection at the first draft is one trial: 40 of them weigh 1 - 0.9^40
        a.observe(4, 0)
    assert a.alpha < 0.05


def test_what_proposing_costs_counts_against_the_drafts():
    """A draft that pays when proposing it is free (prompt lookup) does not when the proposal costs as much as
    the rows it saves (the heads' steps): the planner adds the drafters' own time to the step's."""
    p = planner()
    free = Acceptance(alpha=0.6)
    assert p.plan([free], [7])[0] >= 2
    costly = Acceptance(alpha=0.6, step_seconds=3e-3)  # 3 ms a draft against a 4.4 ms step
    assert p.plan([costly], [7]) == [0]
    assert costly.draft_cost(3) == pytest.approx(9e-3)


def test_trees_are_planned_from_their_measured_gain_per_size():
    """A tree's worth per extra node is gain(k + 1) - gain(k), from trees scored against the answer; its
    growth costs a head step per level."""
    from edge_runtime.spec.tree import DraftTree, TreeGain

    p = planner()
    gain = TreeGain(8, decay=0.0)
    tree = DraftTree([0, 1, 2, 3, 4, 5], [-1, 0, 1, 2, 0, 4], [-1, 0, 1, 2, 3, 4])
    gain.add(tree, 0, 3)
    gain.score([0, 1, 2, 3, 9])  # the answer followed the first branch three deep
    assert gain.gain[:5] == [0.0, 1.0, 2.0, 3.0, 3.0]
    assert p.plan([gain], [8]) == [3]  # the fourth node would earn nothing
    gain.level_seconds = 20e-3  # a level costing far more than a step: no tree
    assert p.plan([gain], [8]) == [0]


def test_a_chain_is_kept_as_far_as_its_drafts_probabilities_pay():
    """A chain drafted first (the attention head's) is worth p_1 ... p_(j+1) tokens for its draft j + 1: the
    planner keeps the drafts the head is sure of, drops those it guesses at, whatever the running estimate."""
    p = planner()
    assert Confidence([0.9, 0.5, 0.2]).marginal(1) == pytest.approx(0.45)
    assert Confidence([0.9, 0.5]).marginal(2) == 0.0  # past the chain
    sure, unsure = Confidence([0.99] * 4), Confidence([0.05, 0.9, 0.9, 0.9])
    assert p.plan([sure], [4]) == [4]
    assert p.plan([unsure], [4]) == [0]
    assert p.plan([Confidence([0.95, 0.9, 0.1, 0.9])], [4]) == [2]  # the third would reach 0.09
    ks = p.plan([sure, Confidence([0.6, 0.5, 0.4, 0.3])], [4, 4])
    assert ks[0] >= ks[1]
    assert p.plan([Confidence([])], [0]) == [0]


def test_the_floor_is_the_gain_at_which_one_more_row_stops_paying():
    """`floor`: a draft reached with that probability leaves the step's tokens per second where they were;
    above it a draft pays, below it not, so a chain drafted by confidence can stop there."""
    p = planner()
    for sequences in (1, 3, 8):
        f = p.floor(sequences, 0.2e-3)
        base = sequences / p.cost(sequences, sequences)
        for gain, pays in ((f * 1.05, True), (f * 0.95, False)):
            rate = (sequences + gain) / (p.cost(sequences + 1, sequences) + 0.2e-3)
            assert (rate > base) == pays
    assert p.floor(1, 0.0) < p.floor(1, 1e-3) < p.floor(8, 1e-3)  # dearer head steps and fuller steps ask more


def test_the_floor_is_never_below_zero_where_measured_costs_dip():
    """Measured step costs can dip where a row is added (noise on a shared machine): the floor is then 0 (every
    draft pays), never negative."""
    dip = planner({1: 5.0, 2: 4.0, 3: 6.0})
    assert dip.cost(2, 1) < dip.cost(1, 1)
    assert dip.floor(1, 0.1e-3) == 0.0 and planner().floor(1, 0.1e-3) > 0.0


def test_a_chain_sized_by_confidence_gets_probes_when_its_idle_count_is_carried():
    """A chain whose drafts never pay is declined step after step; the engine carries its job's idle count into
    each step's `Confidence`, so the planner probes it now and then (its costs and acceptance get measured),
    where a fresh count each step would never reach a probe."""
    p = planner()
    idle, ks = 0, []
    for _ in range(3 * p.probe_every):
        c = Confidence([0.01], idle=idle)
        ks.append(p.plan([c], [1])[0])
        idle = c.idle
    assert ks[0] == 0 and 1 <= ks.count(1) <= 3
    assert all(p.plan([Confidence([0.01])], [1]) == [0] for _ in range(3 * p.probe_every))
