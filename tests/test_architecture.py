"""The layout rules the architecture rests on (docs/architecture.md), checked on the source tree.

- every runtime sub-package has an __init__ docstring saying what it owns;
- no module of the packages is over 400 lines;
- no module imports a name starting with `_` from another project module;
- code outside a runtime sub-package imports it through the package's exported names;
- imports point strictly down the layer order below (LAYERS), including imports inside functions,
  `import x` and `from x import y` alike; packages of one layer do not import each other, except
  the pairs in SAME_LAYER_ALLOWED. `layer_violations(root)` checks any tree laid out like this one.
"""

import ast
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("runtime", "storage", "predictor", "metal")
SUBPACKAGES = sorted(p.parent.name for p in (ROOT / "runtime").glob("*/__init__.py"))

# Lowest first. A module may import its own unit and any unit of a lower layer, nothing else.
# "runtime.api" is the public API: runtime/__init__.py and the modules directly under runtime/
# (api.py, run_stats.py, ...). bench/ and tests/ sit above runtime.cli (they may import anything;
# nothing in the packages imports them), and runtime/data holds data files only (no module: the
# checker reports any module it cannot place).
LAYERS = (
    ("storage", "predictor", "metal", "runtime.checkpoints", "runtime.macos"),
    ("runtime.cache",),
    ("runtime.observe",),
    ("runtime.decode",),
    ("runtime.tune", "runtime.plan"),
    ("runtime.api",),
    ("runtime.serve", "runtime.pipeline", "runtime.doctor"),
    ("runtime.cli",),
    ("bench", "tests"),  # not scanned (they may import anything); listed so that no package imports them
)
# The one import inside a layer: rank 0 of `specmoe serve --pipeline` serves HTTP through
# runtime.serve's Backend and server (runtime/pipeline/serving.py); runtime.serve never imports runtime.pipeline.
SAME_LAYER_ALLOWED = frozenset({("runtime.pipeline", "runtime.serve")})


def _modules():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _imports(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node


def _unit(module: str, layer_of: dict[str, int], api_modules=frozenset({"api"})) -> str | None:
    """The layer unit a dotted module name belongs to, None if unplaced. The API unit is `runtime`
    itself and the modules directly under runtime/ (`api_modules`: runtime/api.py, runtime/run_stats.py)."""
    parts = module.split(".")
    if parts[0] == "runtime":
        if len(parts) == 1 or parts[1] in api_modules:
            return "runtime.api"
        unit = ".".join(parts[:2])
    else:
        unit = parts[0]
    return unit if unit in layer_of else None


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node, me: str, is_package: bool) -> list[tuple[str, tuple[str, ...]]]:
    """Per imported name: the import as written (relative ones resolved) and the module names it may
    load, longest first."""
    if isinstance(node, ast.Import):
        return [(f"import {a.name}", (a.name,)) for a in node.names]
    if isinstance(node, ast.Call):  # importlib.import_module("x") / __import__("x") with a literal name
        name = getattr(node.func, "attr", getattr(node.func, "id", None))
        arg = node.args[0] if node.args else None
        if name in ("import_module", "__import__") and isinstance(arg, ast.Constant) and isinstance(arg.value, str):
            return [(f"{name}({arg.value!r})", (arg.value,))]
        return []
    base = node.module or ""
    if node.level:  # relative: resolved against the importing module's package
        package = me.split(".") if is_package else me.split(".")[:-1]
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join(anchor + ([base] if base else []))
    # `from runtime import cache` loads runtime.cache; `from runtime import load` loads runtime
    return [(f"from {base} import {a.name}", (f"{base}.{a.name}", base)) for a in node.names]


def layer_violations(root: Path, packages=PACKAGES, layers=LAYERS, allowed=SAME_LAYER_ALLOWED) -> list[str]:
    """Every import in the tree at `root` that does not point strictly down `layers`.

    Walks each module's whole AST (imports inside functions, classes and `if` blocks too, and
    importlib.import_module / __import__ of a literal name).
    Also reports a module of `packages` that belongs to no unit of `layers`."""
    layer_of = {unit: i for i, names in enumerate(layers) for unit in names}
    api_modules = frozenset(p.stem for p in (root / "runtime").glob("*.py") if p.stem != "__init__")
    bad = []
    for pkg in packages:
        for path in sorted((root / pkg).rglob("*.py")):
            rel = path.relative_to(root).as_posix()
            me = _module_name(root, path)
            mine = _unit(me, layer_of, api_modules)
            if mine is None:
                bad.append(f"{rel}: {me} is in no layer; place its package in LAYERS")
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"), filename=rel)
            for node in ast.walk(tree):
                if not isinstance(node, (ast.Import, ast.ImportFrom, ast.Call)):
                    continue
                for written, candidates in _imported(node, me, path.name == "__init__.py"):
                    target = next((u for u in (_unit(c, layer_of, api_modules) for c in candidates) if u), None)
                    if target is None or target == mine:
                        continue
                    if layer_of[target] > layer_of[mine]:
                        bad.append(f"{rel}:{node.lineno}: {mine}: {written} ({target}, a higher layer)")
                    elif layer_of[target] == layer_of[mine] and (mine, target) not in allowed:
                        bad.append(f"{rel}:{node.lineno}: {mine}: {written} ({target}, the same layer)")
    return bad


def test_imports_point_down_the_layers():
    assert layer_violations(ROOT) == []


def test_every_runtime_subpackage_has_a_layer():
    placed = {unit for names in LAYERS for unit in names}
    assert {f"runtime.{name}" for name in SUBPACKAGES} <= placed
    assert not list((ROOT / "runtime" / "data").rglob("*.py"))  # data files only


def test_layer_checker_catches_upward_imports_in_a_planted_tree(tmp_path):
    """Each kind of violation, planted in a small tree: top-level, inside a function, relative,
    `import x.y`, `from runtime import sub`, importlib, a same-layer import, and an unplaced package."""
    files = {
        "storage/__init__.py": "",
        "runtime/__init__.py": "def __getattr__(name):\n    from runtime import api\n",
        "runtime/api.py": "from runtime.decode import step\nfrom runtime import tune\nfrom runtime.stats import S\n",
        "runtime/stats.py": "from runtime.observe import trace\n",
        "runtime/cache/__init__.py": "from storage import x\nfrom ..observe import telemetry\n",
        "runtime/observe/__init__.py": "def f():\n    import runtime.stats\n",
        "runtime/decode/__init__.py": "def run():\n    from runtime.tune import split\n    return split\n",
        "runtime/decode/step.py": "import runtime.cache.slab\nfrom . import step\n",
        "runtime/tune/__init__.py": "if True:\n    import runtime.plan.costs\n",
        "runtime/plan/__init__.py": "from runtime.decode import step\n",
        "runtime/serve/__init__.py": "import runtime\n",
        "runtime/pipeline/__init__.py": "from runtime.serve import app\nfrom runtime.doctor import probe\n",
        "runtime/doctor/__init__.py": "",
        "runtime/decode/dynamic.py": "import importlib\nimportlib.import_module('runtime.cli')\n__import__('storage')\n",
        "runtime/cli/bench_hook.py": "def f():\n    from bench.tiny_corpus import read\n",
        "runtime/cli/__init__.py": "from runtime import load\n",
        "runtime/extra/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    found = layer_violations(tmp_path, packages=("storage", "runtime"))
    assert sorted(found) == sorted([
        "runtime/cache/__init__.py:2: runtime.cache: from runtime.observe import telemetry (runtime.observe, a higher layer)",
        "runtime/decode/__init__.py:2: runtime.decode: from runtime.tune import split (runtime.tune, a higher layer)",
        "runtime/tune/__init__.py:2: runtime.tune: import runtime.plan.costs (runtime.plan, the same layer)",
        "runtime/pipeline/__init__.py:2: runtime.pipeline: from runtime.doctor import probe (runtime.doctor, the same layer)",
        "runtime/extra/__init__.py: runtime.extra is in no layer; place its package in LAYERS",
        "runtime/observe/__init__.py:2: runtime.observe: import runtime.stats (runtime.api, a higher layer)",
        "runtime/decode/dynamic.py:2: runtime.decode: import_module('runtime.cli') (runtime.cli, a higher layer)",
        "runtime/cli/bench_hook.py:2: runtime.cli: from bench.tiny_corpus import read (bench, a higher layer)",
    ])


def test_layer_checker_fails_on_one_upward_import_planted_in_a_copy_of_this_tree(tmp_path):
    """The check on the real tree is not vacuous: a decode module reaching up into the doctor (an
    import inside a function, as the host-sync probe once was) is the one violation reported."""
    for pkg in PACKAGES:
        shutil.copytree(ROOT / pkg, tmp_path / pkg, ignore=shutil.ignore_patterns("__pycache__", "data"))
    assert layer_violations(tmp_path) == []
    (tmp_path / "runtime" / "decode" / "planted.py").write_text("def probe():\n    from runtime.doctor import host_sync_us\n")
    found = layer_violations(tmp_path)
    assert found == ["runtime/decode/planted.py:2: runtime.decode: from runtime.doctor import host_sync_us "
                     "(runtime.doctor, a higher layer)"]


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
