#!/usr/bin/env bash
# Quick start, command 2: set up .venv/ if needed, then run the whole test suite.
# pytest's "no tests ran" (exit 5) counts as a failure.
set -uo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$root/scripts/setup.sh" || exit 1
cd "$root"
.venv/bin/python -m pytest -q "$@"
rc=$?
if [ "$rc" -eq 5 ]; then echo "error: no tests ran" >&2; exit 1; fi
exit "$rc"
