#!/usr/bin/env bash
# Quick start, command 1: set up .venv/ if needed, then run the hybrid demo on the embedded default model
# (SmolLM2-135M-Instruct Q4_1): a cloud worker starts on loopback, an easy prompt is answered on the device,
# a hard one is handed to the cloud; the stream is printed with its source markers and timings.
# Extra arguments go to `edge-runtime demo` (--easy P, --hard P, --max-tokens N).
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh"
exec "$root/.venv/bin/edge-runtime" demo "$@"
