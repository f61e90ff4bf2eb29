"""The layout rules the architecture rests on (docs/architecture.md), checked on the source tree.

- every runtime sub-package has an __init__ docstring saying what it owns;
- no module of the packages is over 400 lines;
- no module imports a name starting with `_` from another project module;
- code outside a runtime sub-package imports it through the package's exported names.
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "storage", "predictor", "metal")
SUBPACKAGES = sorted(p.parent.name for p in (ROOT / "runtime").glob("*/__init__.py"))


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node


def test_each_runtime_subpackage_states_what_it_owns():
    assert {"cache", "decode", "observe", "tune", "plan", "cli"} <= set(SUBPACKAGES)
    for name in SUBPACKAGES:
        doc = ast.get_docstring(ast.parse((ROOT / "runtime" / name / "__init__.py").read_text()))
        assert doc and f"runtime.{name}" in doc.splitlines()[0], f"runtime/{name}/__init__.py: no docstring naming it"


@pytest.mark.parametrize("path", list(_modules()), ids=lambda p: str(p.relative_to(ROOT)))
def test_no_module_over_400_lines(path):
    n = len(path.read_text(encoding="utf-8").splitlines())
    assert n <= 400, f"{path.relative_to(ROOT)}: {n} lines; split it by concept"


def test_no_private_names_imported_across_modules():
    bad = []
    for path in _modules():
        for node in _imports(path):
            if node.module.split(".")[0] in PACKAGES:
                bad += [f"{path.relative_to(ROOT)}: {node.module}.{a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad, bad


def test_runtime_subpackages_are_used_through_their_exports():
    bad = []
    for path in _modules():
        rel = path.relative_to(ROOT).parts
        own = rel[1] if rel[0] == "runtime" and len(rel) > 2 else None
        for node in _imports(path):
            parts = node.module.split(".")
            if parts[0] == "runtime" and len(parts) > 2 and parts[1] in SUBPACKAGES and parts[1] != own:
                bad.append(f"{'/'.join(rel)}:{node.lineno} imports {node.module}; use runtime.{parts[1]}")
    assert not bad, bad


def test_a_broken_rule_is_caught(tmp_path):
    """The private-import check is not vacuous: it sees a planted violation."""
    planted = tmp_path / "m.py"
    planted.write_text("from runtime.observe.profile_plot import _helper\n")
    names = [a.name for node in _imports(planted) for a in node.names]
    assert names == ["_helper"] and names[0].startswith("_")
