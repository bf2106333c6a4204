"""Saving and loading: atomic, bit-exact, shared weights stored once, readable by transformers' Auto classes."""

import json

import pytest
import torch
from conftest import make_hf_model
from safetensors import safe_open

import looplm  # noqa: F401  (registers the Auto classes)
from looplm.convert import convert
from looplm.models import ConfigError, from_hf_model, load_checkpoint, save_model


@pytest.fixture(scope="module")
def relaxed():
    vanilla = from_hf_model(make_hf_model("gemma3", num_layers=4))
    return convert(vanilla, loops=2, init="average", norms="per-depth", lora_ranks=4)


def test_round_trip_is_bit_exact(relaxed, tmp_path):
    save_model(relaxed, None, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    a, b = relaxed.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(relaxed(ids).logits, loaded(ids).logits)


def test_auto_classes_open_a_saved_model(relaxed, tmp_path):
    from transformers import AutoModelForCausalLM

    save_model(relaxed, None, tmp_path / "m")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    assert type(auto).__name__ == "LoopLMForCausalLM"
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        assert torch.equal(auto(ids).logits, relaxed(ids).logits)
        out = auto.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=0)
        x = ids
        for _ in range(6):  # greedy by full forwards, no cache
            x = torch.cat([x, relaxed(x).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, x)


def test_shared_weights_are_stored_once(tmp_path):
    vanilla = from_hf_model(make_hf_model("llama", num_layers=4))
    save_model(vanilla, None, tmp_path / "v")
    save_model(convert(vanilla, loops=2, lora_ranks=0), None, tmp_path / "r")

    def layer_bytes(d):
        with safe_open(str(d / "model.safetensors"), "pt") as f:
            return sum(f.get_tensor(k).numel() * 4 for k in f.keys() if ".layers." in k)

    assert layer_bytes(tmp_path / "r") * 2 == layer_bytes(tmp_path / "v")


def test_truncated_checkpoint_is_a_clear_error(relaxed, tmp_path):
    save_model(relaxed, None, tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ConfigError, match="corrupt or truncated"):
        load_checkpoint(tmp_path / "m")


def test_config_weight_mismatch_is_a_clear_error(relaxed, tmp_path):
    save_model(relaxed, None, tmp_path / "m")
    cfg_path = tmp_path / "m" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["intermediate_size"] = 48
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="do not belong together"):
        load_checkpoint(tmp_path / "m")


def test_failed_save_leaves_nothing_behind(relaxed, tmp_path, monkeypatch):
    import looplm.models.checkpoint as ckpt

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(ckpt, "save_file", boom)
    with pytest.raises(OSError):
        save_model(relaxed, None, tmp_path / "m")
    assert list(tmp_path.iterdir()) == []


def test_overwriting_replaces_the_old_checkpoint_whole(relaxed, tmp_path):
    save_model(relaxed, None, tmp_path / "m")
    other = convert(from_hf_model(make_hf_model("gemma3", num_layers=4, seed=1)), loops=2, lora_ranks=0)
    save_model(other, None, tmp_path / "m")
    assert load_checkpoint(tmp_path / "m").config.lora_ranks["q"] == 0
    assert [p.name for p in tmp_path.iterdir()] == ["m"]
