"""Coverage-guided fuzzing (atheris, optional) of the safetensors header parser and store.json.

The hypothesis tests in tests/test_fuzz_inputs.py are the gate; this is the
longer, optional hunt. Each input is written to a file and opened the way the
runtime opens it; a StoreError (or ValueError) is a clean refusal, anything else
is a finding. Defects already pinned by strict-xfail cases in
tests/test_fuzz_inputs.py are skipped unless --strict.

    pip install atheris
    python bench/fuzz_atheris.py header -atheris_runs=200000
    python bench/fuzz_atheris.py manifest -max_total_time=60
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import atheris  # noqa: E402

with atheris.instrument_imports():
    from storage.errors import StoreError
    from storage.safetensors_header import read_header
    from storage.store import ExpertStore

from tests.test_fuzz_inputs import _known_defect  # noqa: E402

STRICT = "--strict" in sys.argv
WORK = Path(tempfile.mkdtemp(prefix="specmoe-fuzz-"))  # libFuzzer exits without cleanup: remove by hand


def _refused(e: Exception) -> bool:
    return isinstance(e, (StoreError, ValueError)) or (not STRICT and _known_defect(e))


def fuzz_header(data: bytes) -> None:
    """The input is the whole file: length field, header JSON, data."""
    path = WORK / "f.safetensors"
    path.write_bytes(data)
    try:
        read_header(path)
    except Exception as e:
        if not _refused(e):
            raise


def _header_seeds(seed_dir: Path) -> None:
    import numpy as np
    from safetensors.numpy import save_file

    save_file({"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.zeros(4, np.uint32)}, str(seed_dir / "two.safetensors"),
              metadata={"format": "mlx"})
    save_file({"w": np.ones((2, 2, 2), np.uint8)}, str(seed_dir / "one.safetensors"))


def _make_store() -> Path:
    from runtime.checkpoints import make_tiny
    from storage.packer import convert

    raw = make_tiny(WORK / "raw", "qwen3_moe", seed=1, layers=2, n_experts=8, top_k=2)
    return convert(raw, WORK / "store")


def fuzz_manifest(data: bytes) -> None:
    (STORE / "store.json").write_bytes(data)
    try:
        ExpertStore.open(STORE).close()
    except Exception as e:
        if not _refused(e):
            raise


if __name__ == "__main__":
    mode = sys.argv[1] if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else "header"
    argv = [sys.argv[0]] + [a for a in sys.argv[1:] if a.startswith("-") and a != "--strict"]
    if mode == "manifest":
        STORE = _make_store()
        seed_dir = WORK / "corpus"
        seed_dir.mkdir()
        shutil.copy(STORE / "store.json", seed_dir / "valid.json")
        argv.append(str(seed_dir))
        target = fuzz_manifest
    else:
        seed_dir = WORK / "corpus"
        seed_dir.mkdir()
        _header_seeds(seed_dir)
        argv.append(str(seed_dir))
        target = fuzz_header
    try:
        atheris.Setup(argv, target)
        atheris.Fuzz()
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
