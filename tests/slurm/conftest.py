"""The cluster tests run against a real SLURM (`make test-slurm` brings up a one-node one with
scripts/slurm_up.sh and sets NORMLAB_TEST_SLURM=1); `make test` skips them."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest


def _slurm_up() -> str | None:
    if os.environ.get("NORMLAB_TEST_SLURM") != "1":
        return "cluster tests: run `make test-slurm` (a one-node SLURM on this machine)"
    if not shutil.which("sbatch") or subprocess.run(["scontrol", "ping"], capture_output=True).returncode != 0:
        return "no SLURM controller answers here: run scripts/slurm_up.sh (root) first"
    return None


def pytest_collection_modifyitems(config, items):
    why = _slurm_up()
    if why:
        for item in items:
            if "tests/slurm/" in str(item.fspath):
                item.add_marker(pytest.mark.skip(reason=why))


@pytest.fixture
def fuse_dir(tmp_path):
    """A FUSE mount (bindfs over a folder of tmp_path, type fuse.bindfs): a filesystem normlab takes as shared (its
    store without WAL, its locks O_EXCL files). Needs root, /dev/fuse and Debian's bindfs; skipped without them."""
    if os.geteuid() != 0 or not shutil.which("bindfs") or not os.path.exists("/dev/fuse"):
        pytest.skip("a FUSE mount needs root, /dev/fuse and bindfs (apt-get install bindfs)")
    src, mnt = tmp_path / "fuse-src", tmp_path / "fuse"
    src.mkdir()
    mnt.mkdir()
    subprocess.run(["bindfs", "-o", "subtype=bindfs", str(src), str(mnt)], check=True)
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)
