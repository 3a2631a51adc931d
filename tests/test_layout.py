"""The layout's two rules: imports point one way, and no module is over 400 lines.

kernels, devices <- edge_runtime <- cloud_fallback <- edge_cli <- examples (DESIGN.md). Every import
is checked, those inside functions too, and so is every `python -m PACKAGE` a module starts.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# what each package may import of ours (itself included)
ALLOWED = {
    "kernels": {"kernels"},
    "devices": {"devices"},
    "edge_runtime": {"kernels", "devices", "edge_runtime"},
    "cloud_fallback": {"kernels", "devices", "edge_runtime", "cloud_fallback"},
    "edge_cli": {"kernels", "devices", "edge_runtime", "cloud_fallback", "edge_cli"},
    "examples": {"kernels", "devices", "edge_runtime", "cloud_fallback", "edge_cli", "examples"},
}
MAX_LINES = 400


def modules() -> list[str]:
    out = []
    for pkg in ALLOWED:
        for folder, _, names in os.walk(os.path.join(ROOT, pkg)):
            out += [os.path.relpath(os.path.join(folder, n), ROOT) for n in names if n.endswith(".py")]
    return sorted(out)


def targets(path: str, source: str) -> list[tuple[int, str]]:
    """(line, top-level package) of every import in `source` and of every `-m PACKAGE` it spells."""
    pkg_parts = os.path.dirname(path).split(os.sep)
    found = []
    for node in ast.walk(ast.parse(source, path)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolved against the file's own package
                base = pkg_parts[: len(pkg_parts) - node.level + 1]
                found.append((node.lineno, (base or [node.module or ""])[0]))
            elif node.module:
                found.append((node.lineno, node.module.split(".")[0]))
        elif isinstance(node, (ast.List, ast.Tuple)):
            elts = node.elts
            for a, b in zip(elts, elts[1:]):
                if isinstance(a, ast.Constant) and a.value == "-m" and isinstance(b, ast.Constant) \
                        and isinstance(b.value, str):
                    found.append((b.lineno, b.value.split(".")[0]))
    return found


def violations(path: str, source: str) -> list[str]:
    own = path.split(os.sep)[0]
    return [f"{path}:{line} imports {target}" for line, target in targets(path, source)
            if target in ALLOWED and target not in ALLOWED[own]]


def test_imports_point_one_way():
    bad = []
    for path in modules():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            bad += violations(path, f.read())
    assert not bad, "imports that point back up:\n" + "\n".join(bad)


@pytest.mark.parametrize("path,source,expected", [
    ("kernels/x.py", "from edge_runtime.errors import E\n", ["kernels/x.py:1 imports edge_runtime"]),
    ("edge_runtime/engine/x.py", "def f():\n    import cloud_fallback.worker\n",
     ["edge_runtime/engine/x.py:2 imports cloud_fallback"]),
    ("edge_runtime/x.py", "cmd = [sys.executable, '-m', 'edge_cli', 'serve']\n", ["edge_runtime/x.py:1 imports edge_cli"]),
    ("cloud_fallback/x.py", "from edge_runtime.engine import sampler\nimport kernels\n", []),
    ("edge_runtime/engine/x.py", "from ..model import transformer\nfrom . import sampler\n", []),
    ("devices/x.py", "import torch, psutil\n", []),
])
def test_the_checker_catches_an_arrow_that_points_back_up(path, source, expected):
    assert violations(path, source) == expected


def test_no_module_is_over_400_lines():
    long = []
    for path in modules():
        with open(os.path.join(ROOT, path), encoding="utf-8") as f:
            n = sum(1 for _ in f)
        if n > MAX_LINES:
            long.append(f"{path}: {n} lines")
    assert not long, "split these modules:\n" + "\n".join(long)


def test_every_folder_of_code_is_a_package():
    for path in modules():
        folder = os.path.dirname(os.path.join(ROOT, path))
        assert os.path.exists(os.path.join(folder, "__init__.py")) or os.path.basename(folder) == "examples", folder
