"""ExpertStore serves identical expert bytes from raw, sharded and packed checkpoints."""

from __future__ import annotations

import json

import numpy as np
import pytest
from safetensors import safe_open

from runtime.checkpoints.tiny import make_tiny
from storage import ExpertKey, ExpertStore, StoreError
from storage.packer import convert


def _bytes(store: ExpertStore, key: ExpertKey) -> bytes:
    views = [np.zeros(t.nbytes, np.uint8) for t in store.layout(key.layer).tensors]
    store.read_into(key, views)
    return b"".join(v.tobytes() for v in views)


def test_expert_bytes_match_stacked_tensor_slices(tiny_dirs):
    path = tiny_dirs["qwen3_moe"]
    store = ExpertStore.open(path)
    lay = store.layout(store.moe_layers[1])
    with safe_open(str(path / "model.safetensors"), "numpy") as f:
        expected = b"".join(np.ascontiguousarray(f.get_tensor(n)[7]).tobytes() for n in lay.tensor_names())
    assert _bytes(store, ExpertKey(lay.layer, 7)) == expected
    assert store.expert_bytes_total == lay.expert_bytes * lay.n_experts * len(store.moe_layers)


def test_raw_sharded_and_packed_agree(tmp_path):
    single = make_tiny(tmp_path / "one", "qwen3_next", seed=3, layers=2, n_experts=8, top_k=2)
    sharded = make_tiny(tmp_path / "two", "qwen3_next", seed=3, layers=2, n_experts=8, top_k=2, shards=3)
    packed = convert(single, tmp_path / "packed")
    stores = [ExpertStore.open(p) for p in (single, sharded, packed)]
    assert [s.kind for s in stores] == ["raw", "raw", "packed"]
    assert len(list(sharded.glob("model-*.safetensors"))) == 3
    for layer in stores[0].moe_layers:
        for e in range(8):
            key = ExpertKey(layer, e)
            blobs = {_bytes(s, key) for s in stores}
            assert len(blobs) == 1
            assert stores[2].verify(key)
    assert stores[0].resident_bytes == stores[2].resident_bytes


def test_packed_records_are_aligned_and_valid_safetensors(packed_dirs):
    store = ExpertStore.open(packed_dirs["mixtral"])
    for layer in store.moe_layers:
        for e in range(store.layout(layer).n_experts):
            (rng,) = store.ranges(ExpertKey(layer, e))
            assert rng.offset % (16 * 1024) == 0
    layer_file = store.ranges(ExpertKey(store.moe_layers[0], 0))[0].path
    with safe_open(layer_file, "numpy") as f:  # the reference library accepts our layout
        assert "e0.gate_proj.weight" in f.keys()


def test_checksum_mismatch_is_detected(tmp_path, tiny_qwen):
    packed = convert(tiny_qwen, tmp_path / "packed")
    store = ExpertStore.open(packed)
    key = ExpertKey(store.moe_layers[0], 5)
    (rng,) = store.ranges(key)
    with open(rng.path, "r+b") as f:
        f.seek(rng.offset + 100)
        byte = f.read(1)
        f.seek(rng.offset + 100)
        f.write(bytes([byte[0] ^ 0x40]))
    assert not store.verify(key)
    assert store.verify(ExpertKey(store.moe_layers[0], 4))


def test_missing_expert_tensor(tmp_path, tiny_qwen):
    from safetensors.numpy import load_file, save_file

    f = tiny_qwen / "model.safetensors"
    w = load_file(str(f))
    del w["model.layers.1.mlp.switch_mlp.up_proj.weight"]
    save_file(w, str(f))
    with pytest.raises(StoreError, match="missing expert tensor up_proj.weight") as err:
        ExpertStore.open(tiny_qwen)
    assert "model.layers.1.mlp.switch_mlp.up_proj.weight" in str(err.value)


def test_unstacked_checkpoint_is_refused(tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    save_file({"model.layers.0.mlp.experts.0.up_proj.weight": np.zeros((4, 4), np.float32)}, str(d / "model.safetensors"))
    with pytest.raises(StoreError, match="mlx_lm.convert"):
        ExpertStore.open(d)


def test_index_path_escaping_the_directory_is_refused(tmp_path, tiny_qwen):
    (tiny_qwen / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "../../etc/passwd"}})
    )
    with pytest.raises(StoreError, match="escapes the model directory"):
        ExpertStore.open(tiny_qwen)


def test_incomplete_store_does_not_open(tmp_path, tiny_qwen):
    from runtime.decode.offloaded_model import OffloadedModel

    packed = convert(tiny_qwen, tmp_path / "packed")
    (packed / "store.json").unlink()
    # Without its manifest a store is only resident weights: nothing says where experts are.
    with pytest.raises(StoreError, match="no stacked routed-expert tensors"):
        OffloadedModel.load(packed)


def test_convert_carries_projection_files_along(tmp_path, tiny_qwen):
    from runtime.decode.pairing import default_projection_path

    projection = default_projection_path(tiny_qwen, {"model_type": "qwen3", "hidden_size": 64})
    projection.write_bytes(b"projection bytes")
    (tiny_qwen / "unrelated.safetensors").write_bytes(b"x")  # other safetensors are the model's, not copied
    packed = convert(tiny_qwen, tmp_path / "packed")
    assert (packed / projection.name).read_bytes() == b"projection bytes"
    assert not (packed / "unrelated.safetensors").exists()
    assert ExpertStore.open(packed).kind == "packed"
