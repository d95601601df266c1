"""Shared fixtures: an isolated cache and a small real-text corpus (no network)."""

from __future__ import annotations

import os

import pytest

if os.environ.get("PYTEST_XDIST_WORKER"):  # `make test` runs two workers on two cores: one thread each
    import torch

    torch.set_num_threads(1)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Now is the winter of our discontent made glorious summer by this sun of York.",
    "All the world's a stage, and all the men and women merely players.",
    "To be, or not to be, that is the question.",
    "Friends, Romans, countrymen, lend me your ears.",
]


@pytest.fixture(autouse=True)
def isolated_cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("NORMLAB_CACHE", str(tmp_path_factory.mktemp("cache")))


@pytest.fixture
def corpus(tmp_path):
    """About 40 KB of English text, deterministic."""
    lines = [SENTENCES[(i * 7) % len(SENTENCES)] for i in range(800)]
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(lines))
    return path
