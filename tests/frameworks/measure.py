"""The largest |logit difference| of every case tests/frameworks checks, as docs/frameworks.md quotes it:
`.venv-frameworks/bin/python -m tests.frameworks.measure` (after `make test-frameworks`)."""

from __future__ import annotations

from tests.frameworks.cases import PATCHED, TESTED
from tests.frameworks.test_frameworks import BASE, OPTIONS, PATCH_OPTIONS, check, check_patch


def main() -> None:
    rows = [(layout, fw, check(layout, fw, BASE)) for layout, fw in TESTED]
    rows += [
        ("pre, tie_embeddings=True", fw, check("pre", fw, BASE.with_(tie_embeddings=True)))
        for fw in ("litgpt", "OLMo-core", "torchtitan")
    ]
    rows += [
        (f"{layout}, {', '.join(f'{k}={v}' for k, v in opts.items())}", fw, check(layout, fw, BASE.with_(**opts)))
        for layout, fw, opts in OPTIONS
    ]
    rows += [
        (f"{layout} (patch, from {base})", fw, check_patch(layout, fw, BASE, base)) for layout, fw, base in PATCHED
    ]
    rows += [
        (
            f"{layout} (patch, from {base}), {', '.join(f'{k}={v}' for k, v in opts.items())}",
            fw,
            check_patch(layout, fw, BASE.with_(**opts), base),
        )
        for layout, fw, base, opts in PATCH_OPTIONS
    ]
    print("| code base | placement (model options) | max abs logit difference |\n|---|---|---|")
    for layout, fw, diff in rows:
        print(f"| {fw} | {layout} | {diff:.1e} |")
    print(f"\nlargest: {max(d for *_, d in rows):.1e} over {len(rows)} cases")


if __name__ == "__main__":
    main()
