"""Where a verification's time goes (issue 18): the engine step, drafting (the head steps), the runner (prefills
included) and its decode calls (the model's rows: layers and output head), timed by wrapping them, over the first
N MT-Bench first turns at 128 tokens, greedy: plain, MTP at k = 3, mtp-ngram at k = 3, then plain and MTP again.
Run from the repo root: env -u OMP_WAIT_POLICY .venv/bin/python bench-results/logs/spec-step-profile/run.py 12"""
import sys, time, collections
from edge_cli.bench.spec import mt_bench_prompts, _run, Tally
from edge_runtime.backends.native import NativeBackend
from edge_runtime.engine import batch_engine, batch_runner, drafting
from edge_runtime.model import fused_decode

acc = collections.defaultdict(float); cnt = collections.Counter()
def wrap(cls, name, key):
    f = getattr(cls, name)
    def g(*a, **k):
        t = time.perf_counter(); r = f(*a, **k); acc[key] += time.perf_counter() - t; cnt[key] += 1; return r
    setattr(cls, name, g)
wrap(batch_engine.BatchEngine, "step", "step")
wrap(drafting.StepDrafter, "add", "draft")
wrap(batch_runner.BatchRunner, "run", "runner")
n = int(sys.argv[1]) if len(sys.argv) > 1 else 12
qs = mt_bench_prompts(n)
nb = NativeBackend(model=None, threads=2)
rows = collections.Counter()
orig = batch_runner.BatchRunner.decode
def dec(self, ids, *a, **k):
    t = time.perf_counter(); r = orig(self, ids, *a, **k); dt = time.perf_counter() - t
    acc["decode"] += dt; acc[f"rows{len(ids)}"] += dt; rows[len(ids)] += 1; return r
batch_runner.BatchRunner.decode = dec
for draft, k in (("none", None), ("mtp", 3), ("mtp-ngram", 3), ("none", None), ("mtp", 3)):
    acc.clear(); cnt.clear(); rows.clear(); t = Tally()
    t0 = time.perf_counter()
    for q in qs:
        _run(nb, draft, k, q, 128, t)
    wall = time.perf_counter() - t0
    s = t.summary()
    print(draft, k, f"wall {wall:.2f}s tok/s {s.get('tok_s')} mean_acc {s.get('mean_accepted')} steps {cnt['step']}")
    for key in ("step", "draft", "runner", "decode"):
        print(f"   {key:8s} {acc[key]*1e3/ max(1,cnt['step']):.3f} ms/step  total {acc[key]:.2f}s")
    for r in sorted(rows):
        print(f"   rows={r}: {rows[r]} calls, {acc[f'rows{r}']*1e3/rows[r]:.3f} ms each")
