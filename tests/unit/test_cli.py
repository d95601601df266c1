"""The command line: preset table, layout printout, errors with exit code 2."""

import pytest

import normlab
from normlab.cli import main
from normlab.layout import PRESETS


def test_layouts_table(capsys):
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    for preset in PRESETS.values():
        assert preset.layout.to_string() in out and preset.source in out


def test_show_prints_resolved_layers(capsys):
    assert main(["show", "mix-ln", "--layers", "8"]) == 0
    out = capsys.readouterr().out
    assert "layout mix-ln" in out and "non-embedding" in out
    assert out.count(" C      C") == 2


def test_bad_layout_exit_code(capsys):
    assert main(["show", "perri"]) == 2
    err = capsys.readouterr().err
    assert "unknown layout preset 'perri'" in err and "Did you mean peri" in err


def test_readme_layout_table_is_current(capsys):
    """docs/layouts.md's preset table is `normlab layouts --markdown`, verbatim."""
    from pathlib import Path

    assert main(["layouts", "--markdown"]) == 0
    table = capsys.readouterr().out.strip()
    page = (Path(__file__).resolve().parents[2] / "docs" / "layouts.md").read_text()
    assert table in page


def test_layouts_lists_the_attention_kinds_beside_the_presets(capsys):
    """Issue 67: MLA and MoDA are attention kinds (model.attention), not layouts; `normlab layouts` lists each after
    the presets, with how it is chosen, its equation and its source; --names keeps to the presets."""
    from normlab.model.config import ATTENTION_KIND_FACTS, ATTENTION_KINDS

    assert set(ATTENTION_KIND_FACTS) == set(ATTENTION_KINDS)
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    tail = out[out.index("attention kinds") :]
    pad = max(map(len, ATTENTION_KIND_FACTS))
    for kind, (how, eq, src) in ATTENTION_KIND_FACTS.items():  # one column of names, the text aligned beside it
        assert f"\n{kind:<{pad}}  {how}\n{'':{pad + 2}}{eq}\n{'':{pad + 2}}{src}" in tail
    assert main(["layouts", "--names"]) == 0
    assert "mla" not in capsys.readouterr().out.split()


def test_help_layouts_and_show_do_not_import_torch():
    """The quick commands answer without torch (about 1.5 s to import here): import structure, not timing."""
    import subprocess
    import sys
    from pathlib import Path

    code = (
        "import sys, contextlib, io\nfrom normlab.cli import main\n"
        "for argv in (['layouts'], ['show', 'hybrid*', '--size', 'kim-3.2b'], "
        "['show', 'peri', '--set', 'layout.h=0.5']):\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n        assert main(argv) == 0, argv\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\nprint('ok')"
    )
    src = Path(__file__).resolve().parents[2] / "src"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={"PYTHONPATH": str(src)})
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-1500:]


@pytest.mark.parametrize(
    "layout,size,opts",
    [("hybrid*", "tiny", {}), ("peri,h=0.5", "moe-micro", {}), ("deepnorm", "micro", {"n_layers": 4, "mlp": "relu"})],
)
def test_show_prints_what_build_model_reports(layout, size, opts, capsys):
    from normlab.model.describe import describe

    normlab.build_model(layout, size, verbose=True, **opts)
    built = capsys.readouterr().out.strip()
    assert describe(layout, size, **opts) == built  # analytic counts equal the measured ones


def test_an_unknown_flag_names_the_closest_of_the_commands_own_flags(capsys):
    """difflib over the command's flags and the words of their help (--learning-rate: lr's "peak learning rate"),
    and the command's own help, not the top level's; exit status 2."""
    for argv, said in (
        (["train", "--learning-rate", "3e-3"], "unrecognized arguments: --learning-rate 3e-3 (did you mean --lr?)"),
        (["convert", "run", "--layot", "peri"], "unrecognized arguments: --layot peri (did you mean --layout?)"),
        (["report", "r", "--bogus"], "unrecognized arguments: --bogus (see normlab report --help)"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and err.startswith(f"normlab {argv[0]}: error: ") and said in err, err
        assert f"(see normlab {argv[0]} --help)" in err and len(err.strip().splitlines()) == 1
