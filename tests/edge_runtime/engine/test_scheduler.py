"""Scheduler: continuous batching driven by a simulated engine (`scheduler_sim.Sim`, no torch, no model)."""
import pytest

from edge_runtime.engine.block_manager import BlockManager
from edge_runtime.engine.scheduler import BATCH, INTERACTIVE, Scheduler, SchedulerConfig, Status
from tests.edge_runtime.engine.scheduler_sim import BS, Sim, oracle_drafter, reference


# ---- admission, decodes, budget ----------------------------------------------------------


def test_admission_within_max_num_seqs_decodes_and_finish_frees_the_slot():
    sim = Sim(64, max_num_seqs=2)
    a = sim.add(range(1000, 1010), max_new=2)
    b = sim.add(range(2000, 2010), max_new=4)
    c = sim.add(range(3000, 3010), max_new=2)
    sim.step()
    sim.step()  # a has its 2 tokens: it leaves at once
    assert a.status is Status.FINISHED and not sim.blocks.has_seq(a.seq_id)
    assert sim.sched.running == [b] and sim.sched.waiting == [c]
    sim.step()  # its slot goes to c
    assert sim.log == [[(a, 0, 10, True), (b, 0, 10, True)], [(a, 10, 11, True), (b, 10, 11, True)],
                       [(b, 11, 12, True), (c, 0, 10, True)]]
    sim.run()
    assert [s.token_ids for s in (a, b, c)] == [reference(range(n, n + 10), k)
                                                for n, k in ((1000, 2), (2000, 4), (3000, 2))]
    assert sim.blocks.stats()["num_used_blocks"] == 0


def test_admission_within_the_token_budget_and_no_overtaking():
    sim = Sim(64, max_num_seqs=4, chunk_size=64, max_num_batched_tokens=68)
    a, b, c = (sim.add(range(1000 * i, 1000 * i + 60), max_new=4) for i in (1, 2, 3))
    d = sim.add(range(4000, 4005), max_new=4)  # would fit the budget left, but is behind b
    for _ in range(3):
        sim.step()
    assert sim.log == [[(a, 0, 60, True)],
                       [(a, 60, 61, True), (b, 0, 60, True)],
                       [(a, 61, 62, True), (b, 60, 61, True), (c, 0, 60, True), (d, 0, 5, True)]]


# ---- chunked prefill -----------------------------------------------------------------------


@pytest.mark.parametrize("num_shared, expected", [
    (0, [(0, 256, False), (256, 512, False), (512, 600, True)]),
    (300, [(288, 512, False), (512, 600, True)]),  # 18 cached blocks: from the hit to 512
])
def test_chunked_prefill_boundaries_are_fixed_beside_decodes(num_shared, expected):
    sim = Sim(128, max_num_seqs=4, max_num_batched_tokens=300, chunk_size=256)
    prompt = list(range(5000, 5600))
    if num_shared:
        sim.add(prompt[:num_shared], max_new=1)
        sim.run()
    d1, d2 = sim.add(range(10), max_new=50), sim.add(range(100, 110), max_new=50)
    sim.step()
    long = sim.add(prompt, max_new=1)
    while long.status is not Status.FINISHED:
        n1, n2 = d1.num_tokens, d2.num_tokens
        sim.step()  # decodes and a prefill chunk mixed in one step
        assert sim.log[-1][:2] == [(d1, n1 - 1, n1, True), (d2, n2 - 1, n2, True)]
    assert long.num_cached_tokens == (288 if num_shared else 0)
    assert sim.chunks_of(long) == expected


# ---- priority ------------------------------------------------------------------------------


def test_interactive_before_batch_and_fcfs_within_a_priority():
    sim = Sim(64, max_num_seqs=1)
    b1 = sim.add(range(1000, 1010), 2, BATCH)
    i1 = sim.add(range(2000, 2010), 2, INTERACTIVE)
    b2 = sim.add(range(3000, 3010), 2, BATCH)
    i2 = sim.add(range(4000, 4010), 2, INTERACTIVE)
    assert sim.sched.waiting == [i1, i2, b1, b2]
    sim.run()
    assert sim.done == [i1, i2, b1, b2]


def test_a_waiting_sequence_that_does_not_fit_blocks_those_behind_it():
    sim = Sim(8, chunk_size=64, max_num_batched_tokens=128)
    big = sim.add(range(1000, 1090), max_new=10)  # 6 blocks, 7 when done
    sim.step()
    w1 = sim.add(range(2000, 2050), max_new=2)  # 4 blocks: never fits beside big
    w2 = sim.add(range(3000, 3005), max_new=2)  # 1 block: would fit, must not overtake
    while big.status is not Status.FINISHED:
        sim.step()
        assert sim.sched.waiting == [w1, w2]
    sim.run()
    assert sim.done == [big, w1, w2]


# ---- preemption by recompute -------------------------------------------------------------


@pytest.mark.parametrize("middle_priority", [BATCH, INTERACTIVE])
def test_preempts_latest_admitted_batch_first_and_recomputes(middle_priority):
    sim = Sim(6, chunk_size=64, max_num_batched_tokens=128)
    needy = sim.add(range(1000, 1010), max_new=30)  # 1 block; needs a 2nd for its 17th token
    sim.step()
    middle = sim.add(range(2000, 2040), max_new=30, priority=middle_priority)  # 3 blocks
    sim.step()
    last = sim.add(range(3000, 3020), max_new=30)  # 2 blocks: the pool is full
    sim.step()
    late = sim.add(range(4000, 4010), max_new=30, priority=BATCH)  # no room: waits
    victim = middle if middle_priority == BATCH else last
    assert sim.blocks.num_free_blocks == 0
    while not (out := sim.step()).preempted:
        pass
    assert out.preempted == [victim] and victim.num_preemptions == sim.sched.num_preemptions == 1
    assert not sim.blocks.has_seq(victim.seq_id) and sim.blocks.num_free_blocks > 0
    assert needy in [c.seq for c in out.chunks]
    assert sim.sched.waiting == [victim, late]  # back at its arrival position, ahead of late
    num_tokens = victim.num_tokens
    while victim.status is Status.WAITING:
        sim.step()
    readmitted = [step for step in sim.log if any(s is victim for s, *_ in step)][-1]
    assert (victim, victim.num_cached_tokens, num_tokens, True) in readmitted
    sim.run()
    assert [s.token_ids for s in (needy, middle, last, late)] == [
        reference(range(a, b), 30) for a, b in ((1000, 1010), (2000, 2040), (3000, 3020), (4000, 4010))]
    assert sim.blocks.stats()["num_used_blocks"] == 0


def test_a_chunk_scheduled_in_the_step_keeps_its_blocks():
    sim = Sim(6, chunk_size=128, max_num_batched_tokens=256)
    first = sim.add(range(1000, 1010), max_new=4, priority=BATCH)
    sim.step()
    second = sim.add(range(2000, 2080), max_new=4)  # 5 blocks, full: its 81st token needs a 6th
    sim.step()
    table = sim.blocks.block_table(first.seq_id)
    out = sim.step()
    # the batch sequence would be the victim, but its decode is already in this step
    assert out.preempted == [second] and [c.seq for c in out.chunks] == [first]
    assert out.chunks[0].block_table == table == sim.blocks.block_table(first.seq_id)
    sim.run()
    assert sim.chunks_of(second) == [(0, 80, True), (80, 81, True), (81, 82, True), (82, 83, True)]
    assert second.token_ids == reference(range(2000, 2080), 4)


def test_unconstrained_and_constrained_runs_give_the_same_tokens():
    prompts = [(list(range(1000 * i, 1000 * i + 7 * i)), 10 + 5 * i, i % 2) for i in range(1, 7)]
    results = []
    for num_blocks in (64, 6):
        sim = Sim(num_blocks, max_num_seqs=4, chunk_size=32, max_num_batched_tokens=40)
        seqs = [sim.add(p, n, prio) for p, n, prio in prompts]
        sim.run()
        results.append(([s.token_ids for s in seqs], sim.sched.num_preemptions))
    assert results[0][0] == results[1][0] == [reference(p, n) for p, n, _ in prompts]
    assert results[0][1] == 0 < results[1][1]


# ---- prefix sharing ----------------------------------------------------------------------


@pytest.mark.parametrize("length", [40, 48])
def test_prefix_sharing_never_serves_the_whole_prompt(length):
    sim = Sim(32)
    prompt = list(range(7000, 7000 + length))
    a = sim.add(prompt, max_new=4)
    sim.step()  # a's prompt is computed and its full blocks committed
    b = sim.add(prompt, max_new=4)
    sim.step()
    assert a.num_cached_tokens == 0 and b.num_cached_tokens == 32
    assert sim.chunks_of(b) == [(32, length, True)]
    sim.run()
    assert a.token_ids == b.token_ids == reference(prompt, 4)


# ---- held, finish, requeue ---------------------------------------------------------------


def test_held_sequence_keeps_its_blocks_but_is_not_scheduled():
    sim = Sim(32)
    a, b = sim.add(range(10), max_new=20), sim.add(range(100, 110), max_new=20)
    sim.step()
    a.held = True
    table = sim.blocks.block_table(a.seq_id)
    for _ in range(3):
        assert [c.seq for c in sim.step().chunks] == [b]
    assert sim.blocks.block_table(a.seq_id) == table and a.status is Status.RUNNING
    b.held = True
    assert not sim.sched.has_work and not sim.step().chunks
    a.held = b.held = False
    sim.step()
    assert sim.log[-1] == [(a, 10, 11, True), (b, 13, 14, True)]
    sim.run()
    assert a.token_ids == reference(range(10), 20) and b.token_ids == reference(range(100, 110), 20)


def test_finish_frees_blocks_at_once_whether_waiting_running_or_held():
    sim = Sim(8, chunk_size=64, max_num_batched_tokens=128)
    running, held = sim.add(range(1000, 1040)), sim.add(range(2000, 2040))  # 3 blocks each
    sim.step()
    waiting = sim.add(range(3000, 3040))  # no room
    held.held = True
    out = sim.sched.schedule()
    assert [c.seq for c in out.chunks] == [running] and sim.sched.waiting == [waiting]
    for seq, num_blocks in ((waiting, 0), (running, 3), (held, 3)):
        used = sim.blocks.stats()["num_used_blocks"]
        sim.sched.finish(seq)
        assert seq.status is Status.FINISHED and not sim.blocks.has_seq(seq.seq_id)
        assert sim.blocks.stats()["num_used_blocks"] == used - num_blocks
        sim.blocks.check_invariants()
    tokens = list(running.token_ids)
    sim.sched.update(out.chunks[0], [7])  # the step ran before the finish: ignored
    assert running.token_ids == tokens and not sim.sched.has_work
    assert sim.sched.running == sim.sched.waiting == [] and sim.blocks.stats()["num_used_blocks"] == 0


def test_requeue_of_a_parked_sequence_recomputes_and_continues():
    sim = Sim(32)
    seq = sim.add(range(500, 540), max_new=30)
    for _ in range(5):
        sim.step()
    sim.sched.finish(seq)  # parked: 45 tokens, 44 computed and committed
    assert sim.blocks.stats()["num_used_blocks"] == 0 and not sim.sched.has_work
    sim.sched.requeue(seq)
    sim.step()
    assert seq.num_cached_tokens == 32 and sim.log[-1] == [(seq, 32, 45, True)]
    sim.run()
    assert seq.token_ids == reference(range(500, 540), 30) and sim.done == [seq]


# ---- config ----------------------------------------------------------------------------------


def test_config_validation():
    for config, match in ((SchedulerConfig(chunk_size=40), "multiple of the block size"),
                          (SchedulerConfig(chunk_size=8), "multiple of the block size"),
                          (SchedulerConfig(8, 263, 256), "at least chunk_size"),
                          (SchedulerConfig(max_num_seqs=0), "max_num_seqs")):
        with pytest.raises(ValueError, match=match):
            Scheduler(BlockManager(4, block_size=BS), config)
    Scheduler(BlockManager(4, block_size=BS), SchedulerConfig(8, 264, 256))  # the boundary is fine


# ---- regressions (both were bugs found by these tests) ---------------------------------------


@pytest.mark.parametrize("when", ["waiting", "preempted"])
def test_held_sequence_is_never_scheduled(when):
    sim = Sim(4, chunk_size=64, max_num_batched_tokens=128)
    needy = sim.add(range(10), max_new=30)  # 1 block; its 17th token needs a 2nd
    sim.step()
    held = sim.add(range(100, 140), max_new=30)  # 3 blocks: the pool is full
    if when == "preempted":
        sim.step()  # admitted; then the client stops reading
    held.held = True
    start = len(sim.log)
    while needy.status is not Status.FINISHED:  # needy's 2nd block preempts held
        sim.step()
    sim.step()  # room again
    assert held.num_preemptions == (1 if when == "preempted" else 0)
    assert not any(s is held for step in sim.log[start:] for s, *_ in step)


def test_admission_that_waits_for_budget_leaves_the_prefix_cache_alone():
    sim = Sim(8, max_num_seqs=2, chunk_size=32, max_num_batched_tokens=34)
    sim.add(range(1000, 1064), max_new=1)
    sim.run()  # 4 cached (evictable) blocks, 4 free
    r = sim.add(range(2000, 2048), max_new=4)  # takes 3 free blocks
    sim.step()
    w = sim.add(range(3000, 3040), max_new=4)
    before = sim.blocks.stats()
    out = sim.sched.schedule()  # r's chunk [32, 48) leaves 18 < 32 tokens: w waits
    assert [c.seq for c in out.chunks] == [r] and sim.sched.waiting == [w]
    after = sim.blocks.stats()
    assert [after[k] - before[k] for k in ("num_cached_blocks", "num_query_tokens")] == [0, 0]


def test_drafts_ride_on_decodes_and_only_accepted_ones_stay():
    """Decode chunks carry drafts in lookahead slots; each step keeps the accepted prefix (all, some or
    none, by oracle_drafter's moving wrong spot), truncates the rest, and the answers stay the reference's."""
    sim = Sim(64, drafter=oracle_drafter, max_num_seqs=4, chunk_size=32, max_num_batched_tokens=64)
    prompts = [list(range(100 * i, 100 * i + 20 + 7 * i)) for i in range(3)]
    seqs = [sim.add(p, max_new=40) for p in prompts]
    accepted_per_step = []
    while sim.sched.has_work:
        before = {s.seq_id: s.num_tokens for s in seqs}
        out = sim.step()
        accepted_per_step += [c.seq.num_tokens - before[c.seq.seq_id] - 1 for c in out.chunks if c.drafts]
        sim.blocks.check_invariants()
    assert [s.token_ids for s in seqs] == [reference(p, 40) for p in prompts]
    assert {0, 1, 2, 3} <= set(accepted_per_step)  # none, some and all of 3 drafts were accepted
    assert sim.blocks.stats()["num_used_blocks"] == 0
