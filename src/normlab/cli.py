"""The `normlab` command line.

    normlab layouts                  the preset table: name, string form, equation, source
    normlab show LAYOUT [--size S]   the resolved per-layer layout and parameter count
    normlab demo                     forward/backward of a few layouts at init, side by side
"""

from __future__ import annotations

import argparse
import sys

from normlab.layout import PRESETS, LayoutError, parse_layout
from normlab.model.config import SIZES, ConfigError


def _layouts(args: argparse.Namespace) -> int:
    rows = [(p.name, p.layout.to_string(), p.equation, p.source) for p in PRESETS.values()]
    if args.names:
        print("\n".join(r[0] for r in rows))
        return 0
    if args.markdown:
        print("| preset | string form | equation | source |\n|---|---|---|---|")
        for name, form, eq, src in rows:
            print(f"| `{name}` | `{form}` | {eq} | {src} |")
        return 0
    heads = ("preset", "string form", "equation", "source")
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(heads[:3])]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths) + "  {}"
    print(fmt.format(*heads))
    for r in rows:
        print(fmt.format(*r))
    return 0


def _show(args: argparse.Namespace) -> int:
    from normlab.model.build import build_model

    overrides = {"n_layers": args.layers} if args.layers else {}
    build_model(args.layout, args.size, verbose=True, **overrides)
    return 0


def _demo(args: argparse.Namespace) -> int:
    from normlab.demo import run_demo

    run_demo(args.layouts.split(","), size=args.size, seed=args.seed)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="normlab",
        description="Normalization placement in Transformer LMs: build, compare and inspect layouts.",
    )
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("layouts", help="list the preset layouts with their equations and sources")
    s.add_argument("--names", action="store_true", help="print the names only")
    s.add_argument("--markdown", action="store_true", help="print a Markdown table (as in the README)")
    s.set_defaults(func=_layouts)
    s = sub.add_parser("show", help="print a layout resolved per layer, with the parameter count")
    s.add_argument("layout", help="preset name or string form, e.g. peri or 'attn=AB,mlp=AB,final'")
    s.add_argument("--size", default="tiny", help=f"size preset ({', '.join(SIZES)})")
    s.add_argument("--layers", type=int, default=None, help="override the number of layers")
    s.set_defaults(func=_show)
    s = sub.add_parser("demo", help="compare layouts at initialization on real text: loss, RMS and grad norm by depth")
    s.add_argument("--layouts", default="post,pre,peri,hybrid", help="comma-separated preset names")
    s.add_argument("--size", default="tiny", help=f"size preset ({', '.join(SIZES)})")
    s.add_argument("--seed", type=int, default=0)
    s.set_defaults(func=_demo)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (LayoutError, ConfigError) as err:
        print(f"normlab: error: {err}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `normlab layouts | head`
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    raise SystemExit(main())
