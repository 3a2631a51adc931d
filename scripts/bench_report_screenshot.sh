#!/usr/bin/env bash
# The bench report page, as the README shows it: docs/screenshots/bench-report.png.
# Writes the report of bench-results/ into a temporary folder, opens its index.html in headless Chromium
# ($CHROMIUM, default chromium) 1200 px wide and keeps the top ($HEIGHT px, default 2400): the table of every
# target and the first plots. The PNG is reduced to 256 colours to stay small. $PYTHON: default .venv/bin/python.
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$root"
python="${PYTHON:-.venv/bin/python}"
out="$(mktemp -d)"
trap 'rm -rf "$out"' EXIT
"$python" -m edge_cli.bench.report --dir bench-results --out "$out" >/dev/null
"${CHROMIUM:-chromium}" --headless=new --no-sandbox --disable-gpu --hide-scrollbars --no-first-run \
    --user-data-dir="$out/profile" --window-size=1200,"${HEIGHT:-2400}" --screenshot="$out/page.png" \
    "file://$out/index.html" 2>/dev/null
mkdir -p docs/screenshots
"$python" - "$out/page.png" docs/screenshots/bench-report.png <<'PY'
import sys

from PIL import Image

Image.open(sys.argv[1]).convert("RGB").quantize(256).save(sys.argv[2], optimize=True)
print(f"wrote {sys.argv[2]}")
PY
