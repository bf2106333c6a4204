"""Shared fixtures: tiny random models of every family (transformers' own classes, the oracle),
and the real embedded SmolLM2 (loaded once per session)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def one_torch_thread():
    """Machines here are shared 2-core VMs: one torch thread avoids OpenMP spin-waiting on busy cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def run_cli(*args, check=True):
    """Run `looplm ARGS` in a fresh process, as a user would; on failure show its stderr."""
    proc = subprocess.run(
        [sys.executable, "-m", "looplm.cli", *map(str, args)], capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"looplm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


def make_hf_model(family: str, num_layers: int = 4, seed: int = 0):
    """A randomly initialised transformers model of a family, with norms and biases perturbed so
    that they matter in comparisons."""
    import transformers as T

    torch.manual_seed(seed)
    small = {**SMALL, "num_hidden_layers": num_layers}
    if family == "llama":
        model = T.LlamaForCausalLM(T.LlamaConfig(**small, tie_word_embeddings=True))
    elif family == "llama-untied":
        model = T.LlamaForCausalLM(T.LlamaConfig(**small, tie_word_embeddings=False, attention_bias=True))
    elif family == "gemma":
        model = T.GemmaForCausalLM(T.GemmaConfig(**small))
    elif family == "gemma2":
        model = T.Gemma2ForCausalLM(T.Gemma2Config(**small, sliding_window=8))
    elif family == "gemma3":
        model = T.Gemma3ForCausalLM(
            T.Gemma3TextConfig(
                **small, sliding_window=8, layer_types=["sliding_attention", "full_attention"] * (num_layers // 2)
            )
        )
    elif family in ("gpt_neox", "gpt_neox-sequential"):
        neox = {k: v for k, v in small.items() if k not in ("num_key_value_heads", "head_dim")}
        model = T.GPTNeoXForCausalLM(T.GPTNeoXConfig(**neox, use_parallel_residual=family == "gpt_neox"))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()


FAMILIES = ["llama", "llama-untied", "gemma", "gemma2", "gemma3", "gpt_neox", "gpt_neox-sequential"]


def save_tiny_llama(directory, tokenizer, norm_noise: float = 0.0):
    """A small randomly initialised Llama checkpoint (SMALL) in Hugging Face format with ``tokenizer``;
    ``norm_noise`` perturbs the norm weights (so that tying them matters)."""
    import transformers as T

    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(**{**SMALL, "vocab_size": len(tokenizer)}, tie_word_embeddings=True))
    if norm_noise:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.add_(torch.randn_like(p) * norm_noise)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory, smollm2_tokenizer):
    """save_tiny_llama's checkpoint with SmolLM2's tokenizer, once per test module."""
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama", smollm2_tokenizer)


SERVE_SMALL = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)


def small_relaxed(**overrides):
    """A random 4-layer model converted to B=2 with rank-8 LoRA and per-depth norms (the weight-format tests')."""
    from looplm.convert import convert
    from looplm.models import LoopLMConfig, LoopLMForCausalLM

    torch.manual_seed(0)
    vanilla = LoopLMForCausalLM(LoopLMConfig(**{**SERVE_SMALL, **overrides})).eval()
    return convert(vanilla, loops=2, init="stepwise", lora_ranks=8, norms="per-depth").eval()


def full_depth_greedy(model, prompt, n, eos=None):
    """Reference decoding: the whole sequence through the model's forward, no cache, for every token."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            tok = int(model(torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(tok)
            if tok == eos:
                break
    return ids[len(prompt) :]


def arrive_one_per_step(sched, reqs):
    """Serve ``reqs``, request i arriving before step i: deterministic mid-flight arrivals, so that
    depth-wise steps really mix loops."""
    pending = list(reqs)
    while pending or sched.has_work():
        if pending:
            sched.submit(pending.pop(0))
        if sched.has_work():
            sched.step()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    from looplm.models import load_model

    return load_model("smollm2-135m")[1]


@pytest.fixture(scope="session")
def smollm2():
    """(looplm vanilla model, tokenizer, transformers model) for the real SmolLM2-135M."""
    from looplm.models import load_hf_reference, load_model

    model, tok = load_model("smollm2-135m")
    hf, _ = load_hf_reference("smollm2-135m")
    return model, tok, hf


@pytest.fixture(scope="session")
def heldout_text():
    from looplm.data import sample_text

    return sample_text()
