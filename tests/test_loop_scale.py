"""The loop scale (Mixture-of-Recursions' per-recursion vector): the block that ends every loop of a cycle core
multiplies its output, loop i's by row i, initialised to ones. Checked against a forward hook that does the same by
hand, at every exit, through the serving engine's mixed-depth steps, saving and loading, quantized weights and
healing; plans without such a block, unrolling and export are refused."""

import pytest
import torch
from conftest import TINY, full_depth_greedy, serve_arriving

from looplm.convert import convert, count_parameters, unroll
from looplm.models import ConfigError, LoopLMConfig, load_checkpoint, save_checkpoint
from looplm.models.quantized import prepare
from looplm.serve import ExitPolicy
from looplm.train.heal.steps import body_params

SIX = dict(TINY, num_hidden_layers=6)  # middle-cycle at B=2: 1 + 2 x 2 + 1


def _vanilla(seed=0):
    from conftest import tiny_model

    return tiny_model(seed, num_hidden_layers=6)


def _scaled(lora_ranks=0, seed=0, strategy="middle-cycle"):
    """B=2 with a loop scale whose rows are far from ones."""
    model = convert(_vanilla(seed), loops=2, strategy=strategy, lora_ranks=lora_ranks, loop_scale=True)
    end = model.model.layers[model.config.plan.loop_end_block]
    with torch.no_grad():
        end.loop_scale.weight.uniform_(0.5, 1.5)
    return model


def _ids(n=2, length=9, seed=1):
    return torch.randint(0, SIX["vocab_size"], (n, length), generator=torch.Generator().manual_seed(seed))


def test_at_ones_the_loop_scale_changes_nothing():
    vanilla = _vanilla()
    plain = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=4)
    scaled = convert(vanilla, loops=2, strategy="middle-cycle", lora_ranks=4, loop_scale=True)
    end = scaled.config.plan.loop_end_block
    assert end == 2  # the prelude's layer 0, shared blocks 1 and 2, the coda's layer 3
    extra = set(scaled.state_dict()) - set(plain.state_dict())
    assert extra == {f"model.layers.{end}.loop_scale.weight"}
    assert torch.equal(scaled.model.layers[end].loop_scale.weight, torch.ones(2, SIX["hidden_size"]))
    assert count_parameters(scaled)["n_emb"] - count_parameters(plain)["n_emb"] == 2 * SIX["hidden_size"]
    with torch.no_grad():
        assert torch.equal(plain(_ids()).logits, scaled(_ids()).logits)


def _by_hand(model):
    """The same weights without a loop scale, and a hook that multiplies the end block's output by row ``slot``."""
    end = model.config.plan.loop_end_block
    rows = model.model.layers[end].loop_scale.weight.detach().clone()
    plain = convert(_vanilla(), loops=2, strategy="middle-cycle", lora_ranks=model.config.lora_ranks["q"])
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "loop_scale" not in k})
    plain.model.layers[end].register_forward_hook(lambda mod, args, out: out * rows[args[1]])
    return plain


def test_each_loop_output_is_scaled_by_its_row_at_every_exit():
    model = _scaled(lora_ranks=4)
    plain = _by_hand(model)
    ids = _ids()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-5)
        _, got, _ = model.model(ids, output_loop_states=True)
        _, want, _ = plain.model(ids, output_loop_states=True)
        for g, w in zip(got, want, strict=True):  # loop 1's exit runs the coda on its scaled state
            assert torch.allclose(model.exit_logits(g), plain.exit_logits(w), atol=1e-5)
        assert not torch.allclose(model(ids).logits, convert(_vanilla(), loops=2, strategy="middle-cycle")(ids).logits)


@pytest.mark.parametrize("scheduler", ["static", "sequence", "depth"])
def test_the_engine_serves_the_scaled_loops_exactly(scheduler):
    model = _scaled(lora_ranks=4)
    prompts = [_ids(1, n, seed=10 + n)[0].tolist() for n in (5, 11, 3)]
    engine, outputs = serve_arriving(model, prompts, 6, scheduler)
    assert outputs == [full_depth_greedy(model, p, 6) for p in prompts]
    if scheduler == "depth":
        assert engine.stats["mixed_stages"] > 0


def test_early_exits_leave_after_the_scaled_loop():
    """Every token after the first leaves after loop 1; with kv mode ``later`` its tokens are the loop-1 exits of a
    teacher-forced forward (a cycle core: with a coda, the prompt's coda keys would be the full depth's)."""
    model = _scaled(strategy="cycle")
    assert model.config.plan.loop_end_block == 2
    prompt = _ids(1, 7)[0].tolist()
    _, (output,) = serve_arriving(
        model, [prompt], 5, "depth", max_batch=2, exit_policy=ExitPolicy("softmax", 0.0), kv_mode="later"
    )
    with torch.no_grad():
        _, states, _ = model.model(torch.tensor([prompt + output]), output_loop_states=True)
        exit1 = model.exit_logits(states[0])[0, len(prompt) : -1].argmax(-1).tolist()
    assert output[1:] == exit1[: len(output) - 1]


def test_saved_and_loaded_and_quantized_it_keeps_its_rows(tmp_path):
    model = _scaled(lora_ranks=4)
    save_checkpoint(model, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    assert loaded.config.loop_scale and loaded.config.conversion["loop_scale"]
    ids = _ids()
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)
        # int8 weights: the rows stay float and scale as before (against the same weights rounded alike, by hand)
        q, by_hand = prepare(load_checkpoint(tmp_path / "m"), "int8"), prepare(_by_hand(model), "int8")
        end = q.config.plan.loop_end_block
        assert torch.equal(q.model.layers[end].loop_scale.weight, model.model.layers[end].loop_scale.weight)
        assert torch.allclose(q(ids).logits, by_hand(ids).logits, atol=1e-5)


def test_healing_trains_the_scale():
    model = _scaled()
    params = body_params(model, "fp32")
    scale = model.model.layers[model.config.plan.loop_end_block].loop_scale.weight
    assert any(p is scale for p in params)
    ids = _ids()
    model(ids, labels=ids).loss.backward()
    assert scale.grad is not None and scale.grad.abs().sum() > 0


def test_plans_without_one_end_block_unrolling_and_export_are_refused(tmp_path):
    with pytest.raises(ConfigError, match="cycle core"):
        convert(_vanilla(), loops=2, strategy="middle-sequence", loop_scale=True)
    with pytest.raises(ConfigError, match="cycle core"):
        LoopLMConfig(**SIX, num_loops=1, loop_scale=True)
    with pytest.raises(ConfigError, match="no vanilla equivalent"):
        unroll(_scaled())


def test_convert_and_info_commands(tmp_path, capsys):
    from looplm.commands import main

    save_checkpoint(_vanilla(), tmp_path / "vanilla")
    out = tmp_path / "scaled"
    args = ["convert", str(tmp_path / "vanilla"), "--loops", "2", "--lora-rank", "0", "--init", "stepwise"]
    assert main([*args, "--loop-scale", "--scored-tokens", "0", "--out", str(out)]) == 0
    assert main(["info", str(out)]) == 0
    assert "a loop scale" in capsys.readouterr().out
    assert main(["unroll", str(out), "--out", str(tmp_path / "dense")]) == 2  # export-gguf unrolls the same way
    assert "no vanilla equivalent" in capsys.readouterr().err


def test_a_model_without_the_new_relaxations_keeps_its_fingerprint():
    """Teacher caches and resumable runs name a model by its architecture: switches it does not use are no part of
    it, so models made before the loop scale and the magnitude existed keep their fingerprints."""
    from looplm.models.config import architecture

    plain = convert(_vanilla(), loops=2, strategy="middle-cycle")
    assert not {"loop_scale", "magnitude"} & set(architecture(plain.config))
    assert architecture(_scaled().config)["loop_scale"] is True
