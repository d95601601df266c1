"""scripts/compare_gatednorm_marin.py's bad input, without JAX (normlab's venv has none): one line saying what was
wrong and what is valid, exit status 2, before anything is imported or built. Its comparison itself needs JAX and a
checkout of marin (docs/frameworks.md gives the command and the numbers); GatedNorm's equation as marin's code
writes it is tests/unit/test_designs_2026h2.py's float64 test."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "compare_gatednorm_marin.py"


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("compare_gatednorm_marin", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(spec.name, None)


def _run(script, monkeypatch, capsys, *args: str) -> tuple[int, str]:
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), *args])
    with pytest.raises(SystemExit) as exit_:
        script.main()
    return exit_.value.code, capsys.readouterr().err


def test_a_folder_without_marins_model_is_refused_in_one_line(script, monkeypatch, capsys, tmp_path):
    code, err = _run(script, monkeypatch, capsys, str(tmp_path))
    assert code == 2 and err.count("\n") == 1
    assert str(tmp_path / "experiments/grug/moe/model.py") in err and "marin-community/marin" in err
    assert list(tmp_path.iterdir()) == []  # nothing written into the folder it was given


def test_float64_norms_only_go_with_a_float64_run(script, monkeypatch, capsys, tmp_path):
    (tmp_path / "experiments/grug/moe").mkdir(parents=True)
    (tmp_path / "experiments/grug/moe/model.py").write_text("")
    code, err = _run(script, monkeypatch, capsys, str(tmp_path), "--norms-float64")
    assert code == 2 and err.count("\n") == 1 and "--dtype float64" in err


def test_without_jax_it_says_which_venv_to_run_in(script, monkeypatch, capsys, tmp_path):
    if importlib.util.find_spec("jax") is not None:
        pytest.skip("jax is installed here: the script would run its comparison")
    (tmp_path / "experiments/grug/moe").mkdir(parents=True)
    (tmp_path / "experiments/grug/moe/model.py").write_text("")
    code, err = _run(script, monkeypatch, capsys, str(tmp_path))
    assert code == 2 and err.count("\n") == 1 and "jax[cpu]==0.10.2" in err
