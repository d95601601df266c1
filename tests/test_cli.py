"""The command line: preset table, layout printout, errors with exit code 2."""

from normlab.cli import main
from normlab.layout import PRESETS


def test_layouts_table(capsys):
    assert main(["layouts"]) == 0
    out = capsys.readouterr().out
    for name, preset in PRESETS.items():
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
    """The README's layout table is `normlab layouts --markdown`, verbatim."""
    from pathlib import Path

    assert main(["layouts", "--markdown"]) == 0
    table = capsys.readouterr().out.strip()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert table in readme
