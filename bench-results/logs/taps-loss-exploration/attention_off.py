import sys, time, json, torch
torch.set_num_threads(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
from edge_runtime.backends.native import NativeBackend
from edge_cli.mtp_data import load_shards, first_prompts
import edge_cli.train_attn as ta
variant, prompts = sys.argv[1], int(sys.argv[2])
backend = NativeBackend(model="default", threads=1, n_ctx=1024, kv_budget="1GiB")
data = first_prompts(load_shards("/root/.cache/edge-runtime/mtp-large-4000"), prompts)
bench = torch.load("/work/mtpdata/mt.pt")
kw = {}
if variant == "noattn":
    orig = ta.AttnDraftHead.__init__
    def init(self, *a, **k):
        orig(self, *a, **k); self.w_o.weight.requires_grad_(False)
    ta.AttnDraftHead.__init__ = init
if variant.startswith("lr"):
    kw["lr"] = float(variant[2:])
if variant.startswith("bs"):
    kw["batch"] = int(variant[2:])
t0 = time.time()
head, rep = ta.train_attention(data["records"], backend, steps=4, hidden=1024, epochs=2, held_out=bench, **kw)
print(variant, json.dumps(rep["epochs"]), time.time() - t0, flush=True)
