"""Ablation: the attention head with its attention on/off vs the MLP head, same data (small set), hard loss."""
import json, sys, time, torch
from edge_runtime.backends.native import NativeBackend
from edge_cli.train_attn import train_attention, mt_bench_records, mlp_figures, MT_BENCH_TOKENS
from edge_cli.mtp_eval import attention_walk
from edge_cli.train_mtp import embedding_table, train

variant = sys.argv[1]
epochs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
torch.set_num_threads(2)
backend = NativeBackend(model="default", threads=2, n_ctx=1024, kv_budget="1GiB")
data = torch.load(".cache/mtp-data.pt")
bench = mt_bench_records(backend, 80, MT_BENCH_TOKENS, ".cache/mtp-mt-bench.pt")
emb = embedding_table(backend)
t0 = time.time()
if variant.startswith("mlp"):
    head, rep = train(data, backend, hidden=1024, epochs=epochs, loss="soft" if "soft" in variant else "hard", readout="ro" in variant)
    f = mlp_figures(head, bench, backend)
else:
    import edge_runtime.spec.attn_head as ah
    if variant.startswith("noattn"):
        orig = ah.AttnDraftHead.__init__
        def init(self, *a, **k):
            orig(self, *a, **k)
            for p in list(self.w_qkv.parameters()) + list(self.w_o.parameters()):
                p.requires_grad_(False)
        ah.AttnDraftHead.__init__ = init
    hidden = 1024 if variant.endswith("1024") else 1536
    batch = 2 if "b2" in variant else 8
    head, rep = train_attention(data["records"], backend, hidden=hidden, epochs=epochs, held_out=bench, batch=batch)
    f = attention_walk(head, bench, emb, 3, MT_BENCH_TOKENS)
    f = {"mean_accepted_k3": f["mean_accepted"], "acceptance_per_position": f["acceptance_per_position"],
         "chain_accuracy": rep["epochs"][-1]["extra"]}
print("RESULT", variant, epochs, round(time.time() - t0), json.dumps({k: f[k] for k in ("mean_accepted_k3", "acceptance_per_position", "chain_accuracy")}), flush=True)
