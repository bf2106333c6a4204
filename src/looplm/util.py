"""Small helpers the command modules of every area share (bottom of the package: imports nothing of it)."""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from .errors import UsageError


def read_text_arg(path: str | None, default: Path | None = None) -> str:
    p = Path(path) if path else default
    if p is None:
        raise UsageError("give a text file with --text FILE")
    if not p.exists():
        raise UsageError(f"text file {p} does not exist")
    text = p.read_text(encoding="utf-8", errors="replace")
    if not text.strip():
        raise UsageError(f"text file {p} is empty; give a file with text in it")
    return text


class Timer:
    def __enter__(self):
        self.start = time.perf_counter()
        return self

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.start


def cpu_model(cpuinfo: str = "/proc/cpuinfo") -> str:
    """The CPU's model name, its widest matrix/vector instructions and its core count, as results name the machine:
    one model name covers parts with and without AVX-512, which train at different speeds."""
    import platform

    name, flags = "", set()
    try:
        with open(cpuinfo) as f:
            for line in f:
                if line.startswith("model name") and not name:
                    name = line.split(":", 1)[1].strip()
                elif line.startswith(("flags", "Features")) and not flags:  # x86, Arm
                    flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    isa = next((label for flag, label in _ISA if flag in flags), None)
    name = name or platform.processor() or platform.machine()
    return f"{name}{f' ({isa})' if isa else ''}, {os.cpu_count()} cores"


# the widest first: the first flag the CPU has names it
_ISA = (
    ("amx_tile", "AMX"),
    ("avx512_bf16", "AVX-512 BF16"),
    ("avx512f", "AVX-512"),
    ("avx2", "AVX2"),
    ("asimd", "NEON"),
)


def machine() -> dict:
    """The machine a result was measured on: CPU model, torch threads, device (and GPU), torch version, time (UTC)."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "cpu": cpu_model(),
        "torch_threads": torch.get_num_threads(),
        "device": "cuda" if cuda else "cpu",
        **({"gpu": torch.cuda.get_device_name()} if cuda else {}),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }


def with_this_machine(machines: list[str]) -> list[str]:
    """A run's ``machines`` (run.json), with the one this process runs on added where it is not the last: the
    minutes a run reports are those machines' (a resumed run may have moved)."""
    m = machine()
    here = m.get("gpu") or m["cpu"]
    return machines if machines[-1:] == [here] else [*machines, here]


def read_jsonl(path: Path) -> list[dict]:
    """The records of a JSON-lines file such as a run's metrics.jsonl (none when it is missing); a line cut by a
    kill is skipped."""
    records = []
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    return records


def read_json(path: Path, what: str, fix: str):
    """The JSON at ``path``. Missing or corrupt, it is a UsageError that names ``what`` the directory should hold and
    the ``fix``."""
    if not path.exists():
        raise UsageError(f"{path.parent} holds no {what} (no {path.name}); {fix}")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is corrupt ({e}); {fix}") from None


def write_json_atomic(path: Path, obj) -> None:
    """Write JSON so that a reader (or a run killed meanwhile) sees the old file or the new one, never half."""
    write_text_atomic(path, json.dumps(obj, indent=2, default=str))


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)


def keep_freed_host_memory() -> bool:
    """For training on CPU: glibc gives freed blocks larger than its mmap threshold (and a heap top larger than its
    trim threshold) back to the kernel, and the next step faults the same memory in again, zeroed page by page: a
    training step then spends a visible share of its time in the kernel. This makes glibc serve large blocks from
    its heap and keep what is freed (mallopt M_MMAP_MAX=0, M_TRIM_THRESHOLD 2 GiB). Only where the process's C
    library is
    glibc; returns whether it applied (elsewhere, nothing changes)."""
    import ctypes
    import platform

    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    m_trim_threshold, m_mmap_max = -1, -4  # malloc.h
    return bool(libc.mallopt(m_mmap_max, 0)) and bool(libc.mallopt(m_trim_threshold, 2**31 - 1))


# One compiled region (`serve --compile`, `heal --compile`) serves every layer of every model in the process, with
# one graph per weight kind, step shape and depth specialisation: benchmarks that serve fp32, int8, int4 and a
# looped model in one process need more entries than dynamo's default of 8, beyond which it silently runs the
# region eagerly.
RECOMPILE_LIMIT = 64


def cpu_compiler() -> str | None:
    """The C++ compiler torch.compile's inductor would build CPU kernels with, or None."""
    return next((c for c in ("g++", "c++", "clang++") if shutil.which(c)), None)


def check_compile_available(device) -> None:
    """A one-line UsageError unless torch.compile's inductor backend can build kernels for ``device``; then
    dynamo's recompile limit is raised to ``RECOMPILE_LIMIT``."""
    import torch

    kind = torch.device(device).type
    if kind == "cpu":
        if cpu_compiler() is None:
            raise UsageError(
                "--compile needs a C++ compiler (g++ or clang++) on the PATH for torch.compile on CPU; "
                "install one (apt install g++) or run without --compile"
            )
    elif kind == "cuda":
        from torch.utils._triton import has_triton

        if not has_triton():
            raise UsageError("--compile on CUDA needs triton (pip install triton); or run without --compile")
    else:
        raise UsageError(f"--compile supports cpu and cuda devices, not {kind}; run without --compile")
    cfg = torch._dynamo.config
    cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
