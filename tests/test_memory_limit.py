"""--memory-limit (runtime/cache/memory_limit.py, context_governor.py): one cap on the process, the expert
cache planned inside it and giving back slots as the KV cache grows, tokens unchanged."""

from __future__ import annotations

import pytest
from mlx_lm import load

from runtime.cache import ContextGovernor, MemoryLimit, activation_bytes, parse_memory_limit
from runtime.decode import generate_tokens
from runtime.decode.offloaded_model import OffloadConfig, OffloadedModel
from tests.conftest import PROMPT, greedy_ids, run_cli


def test_parse_memory_limit():
    assert parse_memory_limit("auto") is None and parse_memory_limit(None) is None
    assert parse_memory_limit("1.5GB") == 1_500_000_000 and parse_memory_limit("900MiB") == 900 * 1024**2
    for bad in ("40%", "lots", "-1GB"):
        with pytest.raises(ValueError, match="--memory-limit"):
            parse_memory_limit(bad)


def test_prefill_chunk_shrinks_only_when_its_activations_do_not_fit():
    cfg = {"num_attention_heads": 32, "hidden_size": 2048, "num_experts_per_tok": 8, "moe_intermediate_size": 768}
    roomy = MemoryLimit(64 * 10**9, 10**9, 10**9)
    tight = MemoryLimit(8 * 10**9, 10**9, 3 * 10**9)
    assert roomy.prefill_step(cfg, context=8192, kv_bytes=10**9) == 2048  # stock chunking when it fits
    step = tight.prefill_step(cfg, context=32768, kv_bytes=5 * 10**8)
    assert 16 <= step < 2048
    share = 0.25 * tight.free_for_context(5 * 10**8)
    assert activation_bytes(cfg, step, 32768) <= share < activation_bytes(cfg, 2 * step, 32768)
    # More KV leaves less for the experts.
    assert tight.expert_room(cfg, 10**8, 4096, 2048) > tight.expert_room(cfg, 2 * 10**8, 4096, 2048)


def test_baseline_is_remeasured_after_loading():
    m = MemoryLimit(10**9, 100, 50)
    assert m.remeasured(rss_bytes=1000, weights_bytes=700).baseline_bytes == 300  # the load added 200
    assert m.remeasured(rss_bytes=700, weights_bytes=650).baseline_bytes == 100  # never below the first reading


def test_limit_shrinks_the_planned_cache_and_a_too_small_limit_is_refused(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    full = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        base = full.plan
    finally:
        full.close()
    # Unlimited ("auto" on this machine's RAM) leaves the plan as it was.
    om = OffloadedModel.load(path, OffloadConfig(budget="100%", memory_limit="auto"))
    try:
        assert om.plan.slots == base.slots and om.context_governor is not None and om.prefill_step == 2048
        m = om.memory_limit
    finally:
        om.close()
    # A limit that leaves room for about half the experts at a 64-token context: the plan halves.
    from runtime.cache.memory_limit import limit_plan

    lay = {l: om.store.layout(l) for l in om.moe_layers}
    kv = 64 * 2 * 3 * 2 * 16 * 4
    # On this tiny model a chunk's attention scores outweigh the experts: the chunk drops to 16 tokens.
    need = m.baseline_bytes + m.resident_bytes + kv + activation_bytes(om.config, 16, 64) + base.budget_bytes // 2
    half = MemoryLimit(int(need / 0.95) + 1, m.baseline_bytes, m.resident_bytes)
    plan, step = limit_plan(base, half, om.config, context_tokens=64, kv_bytes=kv,
                            expert_bytes={l: x.expert_bytes for l, x in lay.items()},
                            n_experts={l: x.n_experts for l, x in lay.items()}, top_k=4)
    assert step == 16 and 14 <= min(plan.slots.values()) <= 16
    assert plan.budget_bytes <= half.expert_room(om.config, kv, 64, step) < plan.budget_bytes + sum(
        x.expert_bytes for x in lay.values())
    with pytest.raises(ValueError, match="--memory-limit .* the minimum here is about"):
        OffloadedModel.load(path, OffloadConfig(budget="100%", memory_limit="10MB"))


def test_slots_give_way_as_the_kv_grows_and_tokens_stay_stock(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    stock, tok = load(str(path))
    ids = tok.encode((PROMPT + " ") * 5)
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        cache, cfg = om.cache, om.config
        row = sum(cache.layouts[l].expert_bytes for l in cache.layers())
        kv_per_token = 2 * 3 * 2 * 16 * 4  # 3 attention layers x K,V x 2 KV heads x head_dim 16 x float32
        # A cap that holds every slot at a 16-token context but not at the prompt's.
        early = activation_bytes(cfg, 16, 16) + (16 + 256) * kv_per_token + 32 * row
        limit = MemoryLimit(int(early / 0.95) + row, 0, 0)
        gov = ContextGovernor(cache, limit, cfg, 2048, kv_per_token=kv_per_token)
        assert gov.slots_for((16 + 256) * kv_per_token, 16) == 32
        late = gov.slots_for((len(ids) + 256) * kv_per_token, len(ids))
        assert 4 <= late < 32
        om.context_governor = gov
        out, _ = generate_tokens(om.model, ids, max_tokens=6, om=om)
        assert out == greedy_ids(stock, ids, 6)
        assert gov.stats.n_shrinks >= 1 and gov.stats.usable < 32
        assert max(cache.usable_slots(l) for l in cache.layers()) == gov.stats.usable
    finally:
        om.close()


def test_cli_refuses_a_bad_memory_limit_and_kv_bits(tiny_dirs):
    base = ["generate", "-m", str(tiny_dirs["qwen3_moe"]), "-p", PROMPT, "-n", "2"]
    code, _, err = run_cli(base + ["--memory-limit", "half"])
    assert code == 2 and "--memory-limit 'half'" in err
    code, _, err = run_cli(base + ["--kv-bits", "7"])
    assert code == 2 and "--kv-bits 7" in err
    code, _, err = run_cli(base + ["--memory-limit", "none", "--kv-bits", "8"])
    assert code == 0, err


def _capped_run(path, stock, ids, *, broken: bool):
    """A run under a cap on a simulated process: the accounted parts plus `extra` bytes the accounting does
    not know of (allocator pools, load transients). The governor measures it (closed loop); each measurement
    is recorded. `broken`: the cache ignores requests to give slots back."""
    om = OffloadedModel.load(path, OffloadConfig(budget="100%"))
    try:
        cache, cfg = om.cache, om.config
        row = sum(cache.layouts[l].expert_bytes for l in cache.layers())
        kv_per_token = 2 * 3 * 2 * 16 * 4  # 3 attention layers x K,V x 2 KV heads x head_dim 16 x float32
        extra = 10 * row  # more than the 5% slack absorbs
        early = activation_bytes(cfg, 16, 16) + (16 + 256) * kv_per_token + 32 * row + extra
        cap = int(early / 0.95) + row  # every slot fits at a 16-token context, with the unknown extra
        seen = []

        def process() -> int:  # what the simulated process holds: the slots in use really are given back
            held = sum(n * cache.layouts[l].expert_bytes for l, n in cache.usable_now().items())
            seen.append(extra + gov.stats.kv_held_bytes + held)
            return seen[-1]

        gov = ContextGovernor(cache, MemoryLimit(cap, 0, 0), cfg, 16, kv_per_token=kv_per_token, measure=process)
        if broken:
            cache.request_usable_slots = lambda n: None
        om.context_governor = gov
        out, _ = generate_tokens(om.model, ids, max_tokens=6, om=om)
        process()  # and at the end
        assert out == greedy_ids(stock, ids, 6)
        return cap, seen, gov, 32 * row + extra + (len(ids) + 256) * kv_per_token
    finally:
        om.close()


def test_a_run_under_a_cap_stays_under_it_and_a_broken_give_back_fails_the_check(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    stock, tok = load(str(path))
    ids = tok.encode((PROMPT + " ") * 5)
    cap, seen, gov, all_slots = _capped_run(path, stock, ids, broken=False)
    assert all_slots > cap  # keeping every slot to the end would go over
    assert len(seen) >= 3 and max(seen) <= cap  # the check: every measurement within the cap
    assert gov.stats.n_shrinks >= 1 and gov.stats.unaccounted_bytes > 0
    cap, seen, gov, _ = _capped_run(path, stock, ids, broken=True)
    assert max(seen) > cap  # slots never given back: the same check fails


# --- auto honours the process's cgroup limit (runtime/cache/cgroup_memory.py) ---------------------------------

def _fake_cgroup(tmp_path, proc_lines: str, files: dict[str, str]):
    """A /proc/self/cgroup text and a cgroup file system root holding `files` (path -> content)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    proc = tmp_path / "cgroup"
    proc.write_text(proc_lines)
    root = tmp_path / "fs"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return proc, root


def test_cgroup_v1_limit_is_the_smallest_from_the_process_cgroup_up(tmp_path, monkeypatch):
    from runtime.cache import cgroup_memory

    proc, root = _fake_cgroup(tmp_path, "9:cpu:/\n4:memory:/box/run\n0::/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: unlimited
        "memory/box/memory.limit_in_bytes": "6000000000\n",  # the parent caps its children
        "memory/box/run/memory.limit_in_bytes": "8000000000\n",
    })
    assert cgroup_memory.cgroup_limit_bytes(proc, root, platform="linux") == 6_000_000_000
    assert cgroup_memory.cgroup_limit_bytes(proc, root, platform="darwin") is None  # macOS keeps its rules
    # A reader that looked at the process's own cgroup only would report 8 GB: the parent's cap is missed.
    monkeypatch.setattr(cgroup_memory, "_ancestors", lambda path: [path.strip("/")])
    assert cgroup_memory.cgroup_limit_bytes(proc, root, platform="linux") == 8_000_000_000


def test_cgroup_v2_and_hybrid_limits_and_no_limit(tmp_path):
    from runtime.cache.cgroup_memory import cgroup_limit_bytes, system_memory_bytes

    proc, root = _fake_cgroup(tmp_path, "0::/user.slice/app\n", {"user.slice/app/memory.max": "4000000000\n",
                                                                  "user.slice/memory.max": "max\n"})
    assert cgroup_limit_bytes(proc, root, platform="linux") == 4_000_000_000
    proc, root = _fake_cgroup(tmp_path / "hybrid", "4:memory:/\n0::/app\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712", "unified/app/memory.max": "3000000000"})
    assert cgroup_limit_bytes(proc, root, platform="linux") == 3_000_000_000
    proc, root = _fake_cgroup(tmp_path / "none", "4:memory:/a\n", {"memory/a/memory.limit_in_bytes": "garbage"})
    assert cgroup_limit_bytes(proc, root, platform="linux") is None  # unreadable counts as no limit
    assert cgroup_limit_bytes(tmp_path / "missing", root, platform="linux") is None
    assert system_memory_bytes(ram_bytes=24 * 10**9, limit_bytes=8 * 10**9) == 8 * 10**9
    assert system_memory_bytes(ram_bytes=24 * 10**9, limit_bytes=None) <= 24 * 10**9


def test_auto_budget_and_auto_memory_limit_honour_the_cgroup(monkeypatch):
    from runtime.cache import budget, cgroup_memory
    from runtime.cache.budget import BudgetSpec, plan_budget
    from runtime.cache.memory_limit import auto_limit_bytes

    args = dict(expert_bytes={0: 10**7}, n_experts={0: 10**4}, top_k=4, resident_bytes=10**9, kv_bytes=10**8)
    capped = plan_budget(BudgetSpec("auto", 0, "auto"), total_memory_bytes=24 * 10**9, working_set_bytes=None,
                         cgroup_bytes=8 * 10**9, **args)
    assert capped.breakdown["usable"] == 8 * 10**9 and capped.breakdown["cgroup_limit"] == 8 * 10**9
    assert capped.budget_bytes <= 8 * 10**9 - 10**9 - 10**8 - capped.breakdown["headroom"]
    # Read from the system: the cgroup reader's answer caps RAM, for the budget and for --memory-limit auto.
    monkeypatch.setattr(cgroup_memory, "cgroup_limit_bytes", lambda *a, **k: 5 * 10**9)
    monkeypatch.setattr(budget, "metal_working_set_bytes", lambda: None)
    assert plan_budget(BudgetSpec("auto", 0, "auto"), **args).breakdown["usable"] == 5 * 10**9
    assert auto_limit_bytes() == 5 * 10**9


def test_auto_reads_a_real_cgroup_limit(tmp_path):
    """Under a real cgroup v1 cap (bench/fullscale_cgroup.py; needs root), --memory-limit auto is the cap."""
    import json
    import os
    import sys

    from tests.bench_scripts import BENCH

    sys.path.insert(0, str(BENCH.parent))
    from bench.fullscale_cgroup import MemoryCgroup, available

    if available():
        pytest.skip(available())
    code = ("import json; from runtime.cache.memory_limit import auto_limit_bytes;"
            "from runtime.cache.cgroup_memory import cgroup_limit_bytes;"
            "print(json.dumps([cgroup_limit_bytes(), auto_limit_bytes()]))")
    out = tmp_path / "out.txt"
    with MemoryCgroup(3 * 10**9) as cg, open(out, "w") as f:
        res = cg.run([sys.executable, "-c", code], stdout=f, env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
    assert res.exit_code == 0, out.read_text()
    limit, auto = json.loads(out.read_text().strip().splitlines()[-1])
    assert limit == res.limit_bytes and auto == limit  # the page-rounded 3 GB, not this machine's RAM


# --- the memory governor's "available" is what is left under the cgroup limit -------------------------------

def test_cgroup_available_is_limit_minus_usage_plus_file_pages_smallest_level(tmp_path):
    from runtime.cache.cgroup_memory import cgroup_available_bytes

    proc, root = _fake_cgroup(tmp_path, "4:memory:/box/run\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "20000000000",
        "memory/box/memory.limit_in_bytes": "6000000000", "memory/box/memory.usage_in_bytes": "5000000000",
        "memory/box/memory.stat": "cache 1\ntotal_active_file 1000000000\ntotal_inactive_file 500000000\n",
        "memory/box/run/memory.limit_in_bytes": "8000000000", "memory/box/run/memory.usage_in_bytes": "5000000000",
    })
    # box: 6 - 5 + 1.5 (page cache the kernel reclaims) = 2.5 GB; run: 8 - 5 = 3 GB (no stat file: no file pages)
    assert cgroup_available_bytes(proc, root, platform="linux") == 2_500_000_000
    assert cgroup_available_bytes(proc, root, platform="darwin") is None
    proc, root = _fake_cgroup(tmp_path / "v2", "0::/app\n", {
        "app/memory.max": "4000000000", "app/memory.current": "4100000000",
        "app/memory.stat": "anon 3900000000\nactive_file 100000000\ninactive_file 100000000\n"})
    assert cgroup_available_bytes(proc, root, platform="linux") == 100_000_000
    proc, root = _fake_cgroup(tmp_path / "none", "4:memory:/a\n", {"memory/a/memory.usage_in_bytes": "5"})
    assert cgroup_available_bytes(proc, root, platform="linux") is None  # no limit: the host's reading stands


def test_governor_reads_what_is_left_under_a_real_cgroup(tmp_path):
    """Under a 2 GB cap (needs root), a process holding 1.2 GB sees < 0.9 GB available and a 2 GB total, and the
    governor's decision at that reading is to shrink; the host's reading (many GB free) would not shrink."""
    import json
    import os
    import sys

    import psutil

    from tests.bench_scripts import BENCH

    sys.path.insert(0, str(BENCH.parent))
    from bench.fullscale_cgroup import MemoryCgroup, available

    if available():
        pytest.skip(available())
    code = ("import json; from runtime.cache import cgroup_memory; from runtime.cache.governor import read_memory,"
            " decide, GovernorConfig; {mutation}"
            "held = bytearray(1_200_000_000); held[::4096] = b'x' * len(held[::4096]);"
            "r = read_memory(); print(json.dumps([r.available_bytes, r.total_bytes, decide(r, 1.0, GovernorConfig())]))")

    def capped(mutation: str = ""):
        out = tmp_path / "out.txt"
        with MemoryCgroup(2 * 10**9) as cg, open(out, "w") as f:
            res = cg.run([sys.executable, "-c", code.format(mutation=mutation)], stdout=f,
                         env={**os.environ, "PYTHONPATH": str(BENCH.parent)})
        assert res.exit_code == 0, out.read_text()
        return res, json.loads(out.read_text().strip().splitlines()[-1])

    res, (avail, total, level) = capped()
    assert total == res.limit_bytes and avail < 0.9e9 and level < 1.0
    if psutil.virtual_memory().available > 4e9:  # a reader of the machine's RAM only: the same checks fail
        _, (avail, total, level) = capped("cgroup_memory.cgroup_available_bytes = lambda: None;"
                                          "cgroup_memory.cgroup_limit_bytes = lambda: None;")
        assert avail > 0.9e9 and total > res.limit_bytes and level == 1.0
