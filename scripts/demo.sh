#!/usr/bin/env bash
# Quick start, command 1: set up .venv/ if needed, then stream a local answer
# from the embedded default model (SmolLM2-135M-Instruct Q4_1) on the native engine.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
prompt="${*:-Explain in three sentences why the sky is blue.}"
exec "$root/.venv/bin/edge-runtime" generate --max-tokens 128 "$prompt"
