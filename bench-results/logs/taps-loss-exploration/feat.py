"""Recompute per-layer residual features for the greedy answers to the first P prompts (torch prefill path)."""
import sys, time, torch
torch.set_num_threads(int(sys.argv[2]) if len(sys.argv) > 2 else 2)
from edge_runtime.backends.native import NativeBackend
from edge_cli.mtp_data import load_shards, first_prompts, large_prompts
from edge_runtime.engine.completion import build_prompt, prompt_ids
from edge_runtime.request import GenerationRequest, SamplingParams
P = int(sys.argv[1])
LAYERS = [2, 8, 14, 20, 26]
backend = NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")
model, runner = backend.model, backend.runner
data = load_shards("/root/.cache/edge-runtime/mtp-large-4000")
N = data["prompts"]
prompts = large_prompts(0)[:P]
recs = data["records"][:P]  # temperature 0 first
fused = model.fused
model.fused = None
cap = {}
LAST = model.cfg.num_layers - 1
for L in LAYERS + [LAST]:
    model.blocks[L].register_forward_hook(lambda m, i, o, L=L: cap.__setitem__(L, o.detach()))
out = []
t0 = time.time()
errs = []
with torch.inference_mode():
    for j, (msgs, r) in enumerate(zip(prompts, recs)):
        req = GenerationRequest(messages=msgs, params=SamplingParams())
        ids = prompt_ids(runner, build_prompt(req, backend.template))[:runner.n_ctx - 160 - 1]
        n = len(r["tokens"])
        seq = ids + r["tokens"][:n - 1].tolist()
        runner.reset()
        model(torch.tensor(seq), 0, all_logits=True)
        a = len(ids) - 1
        feats = {L: cap[L][a:a + n].to(torch.float16).clone() for L in LAYERS}
        # check: the final normed state recomputed vs stored
        from edge_runtime.model.transformer import rms_norm
        hf = rms_norm(cap[LAST][a:a + n], model.norm, model.cfg.norm_eps).float()
        errs.append(float(torch.nn.functional.cosine_similarity(hf, r["hidden"].float(), dim=-1).min()))
        out.append(feats)
        if j % 100 == 0:
            print(j, time.time() - t0, min(errs), flush=True)
torch.save({"layers": LAYERS, "feats": out, "prompts": P}, f"/work/mtpdata/diag/feat-{P}.pt")
print("done", time.time() - t0)
