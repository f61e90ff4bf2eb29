"""Hub ids through a local fake Hugging Face cache (HF_HUB_CACHE/HF_HOME in tmp, HF_HUB_OFFLINE=1):
the cache first, mlx-lm's allow patterns for a download, a one-line error offline. Never the network."""

from __future__ import annotations

import shutil

import huggingface_hub
import pytest
from mlx_lm.utils import DEFAULT_ALLOW_PATTERNS

from runtime.checkpoints import embedded_pair, looks_like_hub_id, resolve_model
from tests.conftest import run_cli

REPO = "mlx-community/Tiny-MoE-4bit"


def fake_hub(root, repo=REPO, commit="0123456789abcdef0123456789abcdef01234567"):
    """A Hugging Face cache holding `repo` at `commit` (the layout huggingface_hub writes)."""
    entry = root / ("models--" + repo.replace("/", "--"))
    snap = entry / "snapshots" / commit
    shutil.copytree(embedded_pair().target, snap)
    (entry / "refs").mkdir(parents=True)
    (entry / "refs" / "main").write_text(commit)
    return snap


@pytest.fixture()
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snap = fake_hub(cache)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    real = huggingface_hub.snapshot_download
    calls = []

    def no_network(*args, **kwargs):
        calls.append(kwargs)
        if not kwargs.get("local_files_only"):
            raise AssertionError("tried to download")
        return real(*args, **kwargs)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_network)
    return snap, calls


def test_hub_id_resolves_from_the_local_cache(offline_cache):
    snap, calls = offline_cache
    assert resolve_model(REPO) == snap
    assert calls and calls[0]["allow_patterns"] == DEFAULT_ALLOW_PATTERNS


def test_commands_take_a_hub_id(offline_cache, tmp_path):
    snap, _ = offline_cache
    code, out, err = run_cli(["info", "-m", REPO])
    assert code == 0 and "qwen3_moe" in out, err
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert run_cli(["generate", "-m", REPO, "-p", "The king", "-n", "4", "--json", str(a)])[0] == 0
    assert run_cli(["generate", "-m", str(snap), "-p", "The king", "-n", "4", "--json", str(b)])[0] == 0
    import json

    assert json.loads(a.read_text())["tokens"] == json.loads(b.read_text())["tokens"]


def test_missing_hub_id_offline_is_one_clear_line(offline_cache, tmp_path):
    code, out, err = run_cli(["generate", "-m", "mlx-community/Not-There", "-p", "hi"])
    lines = [l for l in err.splitlines() if l.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err
    assert "--model mlx-community/Not-There" in lines[0] and "HF_HUB_OFFLINE" in lines[0]
    assert str(tmp_path / "hub") in lines[0]
    code, _, err = run_cli(["generate", "-m", str(embedded_pair().target), "--draft", "someone/no-drafter", "-p", "hi"])
    assert code == 2 and "--draft someone/no-drafter" in err


def test_hf_home_is_honoured(tmp_path, monkeypatch):
    snap = fake_hub(tmp_path / "home" / "hub")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert resolve_model(REPO) == snap


def test_a_local_directory_wins_over_the_hub(tmp_path, monkeypatch):
    local = tmp_path / "mlx-community" / "Tiny-MoE-4bit"
    local.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: pytest.fail("hub consulted"))
    assert resolve_model(REPO).resolve() == local


def test_online_download_uses_mlx_lm_allow_patterns(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setattr("runtime.checkpoints.hub.hub_offline", lambda: False)
    calls = []

    def fake(repo, **kwargs):
        calls.append(kwargs)
        if kwargs.get("local_files_only"):
            raise huggingface_hub.errors.LocalEntryNotFoundError("not cached")
        return str(tmp_path / "downloaded")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake)
    assert resolve_model(REPO) == tmp_path / "downloaded"
    assert [c.get("local_files_only", False) for c in calls] == [True, False]
    assert calls[1]["allow_patterns"] == DEFAULT_ALLOW_PATTERNS

    def failing(repo, **kwargs):
        raise OSError("Temporary failure in name resolution")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(ValueError, match=r"--model mlx-community/Tiny-MoE-4bit: could not download .*name resolution"):
        resolve_model(REPO)


@pytest.mark.parametrize("ref, hub", [("mlx-community/Qwen3-30B-A3B-4bit", True), ("./models/x", False),
                                      ("~/models/x", False), ("/abs/path", False), ("a/b/c", False),
                                      ("model-dir", False), ("../up/x", False)])
def test_what_counts_as_a_hub_id(ref, hub):
    assert looks_like_hub_id(ref) is hub
