"""Scheduler under random workloads (hypothesis): invariants every step, every request completes."""
from hypothesis import given, settings, strategies as st

from edge_runtime.engine.scheduler import BATCH, INTERACTIVE, Status
from tests.edge_runtime.engine.scheduler_sim import BS, Sim, oracle_drafter, reference


# ---- random workload -------------------------------------------------------------------------

BASE = list(range(10_000, 10_300))  # shared prompt heads, so prefix hits happen
ADD = st.tuples(st.just("add"), st.one_of(st.integers(1, 48), st.integers(1, 300)),  # prompt length
               st.integers(0, 300), st.integers(1, 64), st.sampled_from([INTERACTIVE, BATCH]))
OPS = st.lists(st.one_of(
    ADD, ADD, st.tuples(st.just("step"), st.integers(1, 8)),
    st.tuples(st.sampled_from(["cancel", "hold", "release", "park", "unpark"]), st.integers(0, 63)),
), min_size=8, max_size=40)


@settings(max_examples=50, deadline=None)
@given(ops=OPS, chunk_blocks=st.sampled_from([1, 2, 4]), max_num_seqs=st.integers(1, 8),
       extra_budget=st.integers(0, 48), spare_blocks=st.integers(0, 4), drafts=st.booleans())
def test_random_workload(ops, chunk_blocks, max_num_seqs, extra_budget, spare_blocks, drafts):
    chunk_size = chunk_blocks * BS
    # tight, but every request fits the pool alone (prompt + max_new tokens)
    need = max([-(-(op[1] + op[3]) // BS) for op in ops if op[0] == "add"], default=1)
    sim = Sim(need + spare_blocks, drafter=oracle_drafter if drafts else None, max_num_seqs=max_num_seqs, chunk_size=chunk_size,
              max_num_batched_tokens=chunk_size + max_num_seqs + extra_budget)
    live, parked, expected = [], [], {}
    for op in ops:
        if op[0] == "add":
            _, length, shared, max_new, priority = op
            shared = min(shared, length)
            prompt = BASE[:shared] + [20_000 + 1000 * len(sim.max_new) + j for j in range(length - shared)]
            seq = sim.add(prompt, max_new, priority)
            live.append(seq)
            expected[seq] = reference(prompt, max_new)
        elif op[0] == "step":
            for _ in range(op[1]):
                sim.step()
        else:
            live = [s for s in live if s.status is not Status.FINISHED]
            pool = parked if op[0] == "unpark" else live
            if not pool:
                continue
            seq = pool[op[1] % len(pool)]
            if op[0] in ("hold", "release"):
                seq.held = op[0] == "hold"
            elif op[0] == "unpark":
                sim.sched.requeue(seq)
                parked.remove(seq)
                live.append(seq)
            else:  # cancel or park: finish() either way
                sim.sched.finish(seq)
                live.remove(seq)
                if op[0] == "park":
                    parked.append(seq)
                else:
                    del expected[seq]
        sim.blocks.check_invariants()
    for seq in parked:
        sim.sched.requeue(seq)
    for seq in expected:
        seq.held = False
    sim.run()
    assert all(s.status is Status.FINISHED for s in expected)
    assert {s: s.token_ids for s in expected} == expected
    sim.blocks.check_invariants()
    assert sim.blocks.stats()["num_used_blocks"] == 0
