"""Load a bench/ script as a module by its file (bench/ is not a package), for tests of its pure functions.

The module is registered in sys.modules only while it executes: dataclasses look their module up then, and a later
load gets a fresh copy."""

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parent.parent / "bench"


def load_bench_script(name: str):
    """bench/<name>.py, executed as a module named `name`."""
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    try:
        spec.loader.exec_module(module)
    finally:
        sys.modules.pop(spec.name, None)
    return module
