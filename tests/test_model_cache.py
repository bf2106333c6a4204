"""The cached float32 copy of an embedded model is keyed by what it was made from, so that a new wheel, a
reinstalled file or a changed import never reads a stale copy."""

from __future__ import annotations

import os

from looplm.models import loading


def test_the_cached_copy_is_keyed_by_the_file_and_the_import(tmp_path, monkeypatch):
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"weights")
    monkeypatch.setattr(loading, "embedded_gguf", lambda name: gguf)
    monkeypatch.setenv("LOOPLM_CACHE", str(tmp_path / "cache"))
    first = loading.embedded_copy("smollm2-135m")
    assert first.parent == tmp_path / "cache" / "models" and first.name.startswith("smollm2-135m-")
    assert loading.embedded_copy("smollm2-135m") == first  # stable while nothing changes

    os.utime(gguf, ns=(0, gguf.stat().st_mtime_ns + 10**9))  # a reinstall rewrites the file
    reinstalled = loading.embedded_copy("smollm2-135m")
    assert reinstalled != first

    gguf.write_bytes(b"other weights")  # another size
    assert loading.embedded_copy("smollm2-135m") not in (first, reinstalled)

    monkeypatch.setattr(loading, "CACHE_FORMAT", loading.CACHE_FORMAT + 1)  # the import changed
    key_now = loading.embedded_copy("smollm2-135m")
    monkeypatch.setattr(loading, "CACHE_FORMAT", loading.CACHE_FORMAT - 1)
    assert loading.embedded_copy("smollm2-135m") != key_now
