"""Every family feature is visible at the test scale, and every family converts, saves, serves and
exports (or is refused) like the first four.

Visibility: each family is built with std-0.2 weights (test_models_families.make_family_model); here the
feature is switched off in looplm's copy of the model, and its logits must then be far from transformers'
(a parity test at 1e-5 cannot pass with the feature missing). Features the first families' tests did not
bind at all (Gemma 2's soft-caps at transformers' 0.02 init, linear and llama3 rope scaling) get their own
models at the same scale.
"""

import pytest
import torch
from conftest import SMALL, full_depth_greedy
from test_models_families import INIT, NEW_FAMILIES, TOLERANCE, make_family_model, max_diff

from looplm.convert import INITS, convert, unroll
from looplm.errors import UsageError
from looplm.models import ConfigError, LoopLMConfig, LoopLMForCausalLM, config_from_hf, from_hf_model


def changed_config(config: LoopLMConfig, **changes) -> LoopLMConfig:
    fields = config.to_dict()
    for key in ("model_type", "transformers_version", "architectures"):
        fields.pop(key, None)
    return LoopLMConfig(**{**fields, **changes})


def switched_off(model: LoopLMForCausalLM, **changes) -> LoopLMForCausalLM:
    """``model`` with config ``changes`` (a feature switched off), holding the same weights."""
    off = LoopLMForCausalLM(changed_config(model.config, **changes)).eval()
    off.load_state_dict(model.state_dict(), strict=False)  # a switched-off feature's weights are left out
    if off.config.tie_word_embeddings:
        off.tie_weights()
    return off


def _gemma2_capped():
    import transformers as T

    torch.manual_seed(0)
    config = T.Gemma2Config(
        **SMALL,
        initializer_range=INIT,
        sliding_window=8,
        query_pre_attn_scalar=16,  # head_dim (Gemma 2 2B/9B's choice; the default 256 shrinks scores 4x here)
        attn_logit_softcapping=5.0,  # Gemma 2 ships 50 and 30; smaller caps bind on a small model
        final_logit_softcapping=3.0,
    )
    return T.Gemma2ForCausalLM(config).eval()


def _model(family):
    return _gemma2_capped() if family == "gemma2-capped" else make_family_model(family)


FULL_ATTENTION = {"depth_attention": None, "sliding_window_size": None}
DEFAULT_ROPE = {"rope": {"full": {"theta": 10000.0, "type": "default", "partial": 1.0}}}
FEATURES = [  # (family, what is switched off, config changes that switch it off)
    ("gemma2-capped", "attention logit soft-cap", {"attn_logit_softcap": None}),
    ("gemma2-capped", "final logit soft-cap", {"final_logit_softcap": None}),
    ("llama-linear-rope", "linear rope scaling", DEFAULT_ROPE),
    ("llama3", "llama3 rope scaling", {"rope": {"full": {"theta": 500000.0, "type": "default", "partial": 1.0}}}),
    ("mistral", "sliding window", FULL_ATTENTION),
    ("qwen2", "sliding window", FULL_ATTENTION),
    ("qwen2", "q/k/v biases", {"attention_bias": False}),
    ("qwen3", "sliding window", FULL_ATTENTION),
    ("qwen3", "per-head q/k norms", {"qk_norm": False}),
    ("phi3", "sliding window", FULL_ATTENTION),
    ("phi3", "partial rotary", DEFAULT_ROPE),
    ("olmo2", "q/k norms over the whole projection", {"qk_norm": False}),
    ("olmo2", "post-norms", {"sandwich_norms": False}),
    ("olmo3", "sliding window", FULL_ATTENTION),
    ("smollm3", "NoPE layers", {"depth_rope": None}),
    ("smollm3", "sliding window", FULL_ATTENTION),
]


@pytest.mark.parametrize("family,feature,changes", FEATURES, ids=[f"{f}-{n}" for f, n, _ in FEATURES])
def test_each_feature_is_exact_and_visible(family, feature, changes):
    hf = _model(family)
    ours = from_hf_model(hf)
    ids = torch.randint(0, 128, (2, 24))  # past every window (8) and Llama 3's shrunk original context (16)
    with torch.no_grad():
        want = hf(ids).logits
        assert max_diff(ours(ids).logits, want) < TOLERANCE
        missing = max_diff(switched_off(ours, **changes)(ids).logits, want)
    assert missing > 1000 * TOLERANCE, f"{family} without {feature} is only {missing} off: the test cannot see it"


def test_llama3_rope_has_llama_3_2_shapes():
    """Llama 3.2 1B/3B: a tied head, four query heads per KV head, rope theta 500000 with llama3 scaling."""
    c = from_hf_model(make_family_model("llama3")).config
    assert c.tie_word_embeddings and c.num_attention_heads == 4 * c.num_key_value_heads
    assert c.rope["full"]["type"] == "llama3" and c.rope["full"]["factor"] == 32.0


# --- conversion, checkpoints, serving and export of the newer families --------------------------


@pytest.mark.parametrize("family", NEW_FAMILIES)
@pytest.mark.parametrize("strategy", ["cycle", "sequence", "cycle-rev"])
def test_full_rank_per_depth_recovers_the_original(family, strategy):
    hf = make_family_model(family)
    relaxed = convert(
        from_hf_model(hf),
        loops=2,
        strategy=strategy,
        init="average",
        norms="per-depth",
        lora_ranks="full",
        lora_init="svd",
    )
    ids = torch.randint(0, 128, (2, 20))
    with torch.no_grad():
        ref = hf(ids).logits
        # SVD at full rank restores each weight to float32 rounding, which std-0.2 weights amplify a little
        assert max_diff(relaxed(ids).logits, ref) < 1e-4
        assert max_diff(unroll(relaxed)(ids).logits, ref) < 1e-4


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_every_init_converts(family):
    from looplm.convert.aware import collect_calibration

    vanilla = from_hf_model(make_family_model(family))
    calib = collect_calibration(vanilla, torch.randint(0, 128, (4, 16)))
    ids = torch.randint(0, 128, (1, 12))
    for init in INITS:
        model = convert(vanilla, loops=2, init=init, lora_ranks=4, calibration=calib)
        with torch.no_grad():
            logits = model(ids).logits
        assert logits.shape == (1, 12, 128) and torch.isfinite(logits).all(), init


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_save_load_and_auto_classes_round_trip(family, tmp_path):
    from transformers import AutoModelForCausalLM

    import looplm  # noqa: F401  (registers the Auto classes)
    from looplm.models import load_checkpoint, save_model

    relaxed = convert(from_hf_model(make_family_model(family)), loops=2, norms="per-depth", lora_ranks=4)
    save_model(relaxed, None, tmp_path / "m")
    loaded = load_checkpoint(tmp_path / "m")
    auto = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(0, 128, (1, 12))
    with torch.no_grad():
        want = relaxed(ids).logits
        assert torch.equal(loaded(ids).logits, want)
        assert torch.equal(auto(ids).logits, want)
        auto.generation_config.eos_token_id = None  # full_depth_greedy does not stop either
        out = auto.generate(ids, max_new_tokens=14, do_sample=False, pad_token_id=0)  # past the window
    assert out[0, 12:].tolist() == full_depth_greedy(relaxed, ids[0].tolist(), 14)


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_engine_equals_full_depth_greedy(family):
    """The serving engine (depth-wise scheduler: loops and LoRA slots mixed in one step) decodes what
    full-depth greedy decoding of the same relaxed model does."""
    from conftest import arrive_one_per_step

    from looplm.serve import Engine, Request, make_scheduler

    model = convert(from_hf_model(make_family_model(family)), loops=2, norms="per-depth", lora_ranks=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 128, (n,), generator=g).tolist() for n in (5, 11, 3, 9)]
    lens = [12, 4, 10, 6]  # 5 + 12 tokens: past the window of 8
    want = [full_depth_greedy(model, p, n) for p, n in zip(prompts, lens)]
    engine = Engine(model, max_batch=3, max_seq_len=64)
    reqs = [Request(p, n) for p, n in zip(prompts, lens)]
    arrive_one_per_step(make_scheduler("depth", engine), reqs)
    assert [r.output for r in reqs] == want
    assert engine.stats["mixed_stages"] > 0  # some steps mixed loops, so per-token slots were exercised


GGUF_REFUSALS = {
    "mistral": "sliding-window attention",
    "llama3": "llama3 rope scaling",
    "qwen2": "attention biases",
    "qwen2-tied": "attention biases",
    "qwen3": "q/k norms",
    "phi3": "partial rotary",
    "olmo2": "post-norms, q/k norms",
    "olmo3": "post-norms, q/k norms",
    "smollm3": "NoPE",
}


@pytest.mark.parametrize("family", NEW_FAMILIES)
def test_gguf_export_refuses_what_the_llama_architecture_lacks(family, tmp_path):
    from looplm.convert.gguf_export import export_gguf

    model = from_hf_model(make_family_model(family))
    with pytest.raises(UsageError, match=GGUF_REFUSALS[family]):
        export_gguf(model, object(), tmp_path / "m.gguf")
    assert not (tmp_path / "m.gguf").exists()


def test_gguf_export_takes_a_mistral_whose_window_never_binds(tmp_path):
    """A window as long as the context is plain causal attention: llama.cpp's llama architecture runs it."""
    import gguf
    from test_gguf_export import tiny_tokenizer

    from looplm.convert.gguf_export import export_gguf

    tok = tiny_tokenizer()
    c = from_hf_model(make_family_model("mistral")).config
    assert "sliding" in c.depth_attention
    vanilla = LoopLMForCausalLM(
        changed_config(c, vocab_size=len(tok), sliding_window_size=c.max_position_embeddings)
    ).eval()
    export_gguf(vanilla, tok, tmp_path / "m.gguf")
    assert gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["general.architecture"].contents() == "llama"


# --- refusals ------------------------------------------------------------------------------------


def _refused_configs():
    import transformers as T

    small = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    longrope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0] * 4,
        "long_factor": [2.0] * 4,
        "original_max_position_embeddings": 64,
    }
    return [
        (T.MixtralConfig(**small), "mixture of experts"),
        (T.Qwen2MoeConfig(**small), "mixture of experts"),
        (T.OlmoeConfig(**small), "mixture of experts"),
        (T.MllamaTextConfig(**small, cross_attention_layers=[1]), "cross-attention"),
        (T.T5Config(), "encoder-decoder"),
        (T.Phi3Config(**small, max_position_embeddings=256, rope_parameters=longrope), "'longrope'"),
        (T.LlamaConfig(**small, rope_parameters={"rope_type": "yarn", "factor": 4.0}), "'yarn'"),
        (T.GPT2Config(), "not supported"),
    ]


@pytest.mark.parametrize("i", range(8))
def test_unfaithful_architectures_are_refused_with_the_feature_named(i):
    config, feature = _refused_configs()[i]
    with pytest.raises(ConfigError, match=feature) as err:
        config_from_hf(config)
    assert "\n" not in str(err.value)
