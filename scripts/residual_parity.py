"""Dump what every layout builds, computes and trains to, for comparing two trees bit for bit.

For every preset of ``normlab layouts`` and a few layout strings mixing residual options, at the ``nano`` size with
a fixed seed: the canonical string form and the build-time table, the parameters (names in order, shapes and
values: checkpoint keys and the optimizer's parameter order), the module paths (what forward hooks and probes
address), the logits and hidden states on a fixed batch, the diagnostics' probe rows (layer, site, metric, value),
and the loss and parameters after 3 AdamW steps of normlab's optimizer (its weight-decay groups included).

    python scripts/residual_parity.py dump OUT.pt          # one file for the tree on PYTHONPATH
    python scripts/residual_parity.py compare A.pt B.pt    # every difference; exit 1 if any
    python scripts/residual_parity.py resume DIR           # `normlab train` stopped at step 8, resumed to 12
    python scripts/residual_parity.py compare-runs DIR_A DIR_B

``resume`` trains a few layouts with residual parameters through the command line, interrupted inside step 8 (after
the step-6 checkpoint) and resumed; ``compare-runs`` compares two such folders file by file, timings left out.

Run ``dump`` on two trees and ``compare`` the files: identical output means the two trees build, name, compute and
train every layout identically.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

EXTRA = (
    "peri,h=0.5,alpha=deepnorm",
    "pre,h-scalar,skip-scalar,gpas,lns",
    "pre,streams=2,mix=mhc,h=0.5,lns",
    "pre,streams=3,h-channel,h=0.1",
    "pre,attnres=2,h-channel,h=0.1",
    "pre,attnres=full,lns",
    "spannorm,alpha=1.5",
    "post,alpha=admin,h-channel,h=0.2",
    "hybrid,skip-scalar,gpas",
    "normformer,attn=gsAB,alpha=admin,h-channel",
    "ngpt,lns",
    "keel,gpas,h=0.7",
    "mix-ln,alpha=keel",
)


def _one(name: str, n_layers: int) -> dict[str, Any]:
    import normlab
    from normlab.config.train import TrainConfig
    from normlab.diagnostics.probes import Probes
    from normlab.layout import as_layout
    from normlab.train.optim import make_optimizer

    lay = as_layout(name)
    model = normlab.build_model(name, "nano", seed=0, n_layers=n_layers)
    out: dict[str, Any] = {
        "string": lay.to_string(),
        "table": model.resolved.table(),
        "params": [(k, tuple(p.shape)) for k, p in model.named_parameters()],
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "modules": [(k, type(m).__name__) for k, m in model.named_modules()],
    }
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    y = torch.randint(0, model.config.vocab_size, (2, 16), generator=gen)
    res = model(x, return_hidden_states=True)
    out["logits"] = res.logits.detach().clone()
    out["hidden"] = [h.detach().clone() for h in res.hidden_states]
    out["probes"] = [(r["layer"], r["site"], r["metric"], r["value"]) for r in Probes(model, (x, y)).record(0)]
    opt = make_optimizer(model, TrainConfig.of(lr=3e-3, weight_decay=0.1))
    losses = []
    for _ in range(3):
        loss = model(x, targets=y).loss
        losses.append(loss.item())
        opt.zero_grad()
        loss.backward()
        opt.step()
    out["losses"] = losses
    out["after"] = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def dump(path: str) -> None:
    from normlab.layout.presets import PRESETS

    torch.use_deterministic_algorithms(True)
    cases = [(p, 2) for p in PRESETS] + [(s, 2) for s in EXTRA] + [("attnres", 3), ("pre-mhc", 3)]
    result = {f"{name}@{n}": _one(name, n) for name, n in cases}
    torch.save(result, path)
    print(f"{len(result)} layouts -> {path}")


RESUMED = ("pre-mhc", "post,alpha=admin,h-channel", "attnres", "pre-lambda", "ngpt")
# what differs between two runs of one tree: timings, Python's and numpy's RNG states (seeded by the OS; normlab
# draws nothing from them), and the folder's own path
_TIMING = ("time", "tok_per_s", "mfu", "seconds", "wall", "device_name", "memory", "python", "numpy")
_PATHS = ("out", "command")


def resume(folder: str) -> None:
    from pathlib import Path

    from normlab.cli import main
    from normlab.data.dataset import TokenData

    real = TokenData.train_window

    def failing(self: Any, step: int, *a: Any, **k: Any) -> torch.Tensor:
        if step == 8:
            raise KeyboardInterrupt("simulated interruption")
        return real(self, step, *a, **k)

    for lay in RESUMED:
        out = Path(folder) / lay.replace(",", "_").replace("=", "_")
        argv = ["train", "--layout", lay, "--size", "nano", "--steps", "12", "--ckpt-every", "3", "--keep-last", "5"]
        argv += ["--probe-every", "3", "--eval-every", "3", "--seed", "0", "--no-progress", "--out", str(out)]
        TokenData.train_window = failing  # type: ignore[method-assign]
        try:
            main(argv)
        except KeyboardInterrupt:
            pass
        finally:
            TokenData.train_window = real  # type: ignore[method-assign]
        main(argv)


def _scrub(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _scrub(v) for k, v in value.items() if k not in _PATHS and not any(t in str(k) for t in _TIMING)}
    if isinstance(value, list):
        return [_scrub(v) for v in value]
    return value


def compare_runs(a_dir: str, b_dir: str) -> int:
    import json
    from pathlib import Path

    found: list[str] = []
    a_root, b_root = Path(a_dir), Path(b_dir)
    files = sorted(p.relative_to(a_root) for p in a_root.rglob("*") if p.is_file())
    for rel in files:
        a, b = a_root / rel, b_root / rel
        if not b.exists():
            found.append(f"{rel}: missing")
        elif rel.suffix == ".pt":
            loaded = (_scrub(torch.load(p, weights_only=False)) for p in (a, b))
            _diff(*loaded, str(rel), found)
        elif rel.suffix in (".json", ".jsonl"):
            if rel.suffix == ".json":
                rows_a, rows_b = [_scrub(json.loads(a.read_text()))], [_scrub(json.loads(b.read_text()))]
            else:
                rows_a = [_scrub(json.loads(line)) for line in a.read_text().splitlines() if line.strip()]
                rows_b = [_scrub(json.loads(line)) for line in b.read_text().splitlines() if line.strip()]
            _diff(rows_a, rows_b, str(rel), found)
    for line in found[:50]:
        print(line)
    print(f"{len(files)} files compared: {len(found)} differences")
    return 1 if found else 0


def _diff(a: Any, b: Any, where: str, found: list[str]) -> None:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.shape != b.shape or a.dtype != b.dtype or not torch.equal(a, b):
            found.append(f"{where}: tensors differ")
    elif isinstance(a, dict) and isinstance(b, dict):
        if list(a) != list(b):
            found.append(f"{where}: keys differ: {sorted(set(a) ^ set(b))[:6]} (or their order)")
        for k in a:
            if k in b:
                _diff(a[k], b[k], f"{where}.{k}", found)
    elif isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            found.append(f"{where}: {len(a)} vs {len(b)} entries")
        for i, (u, v) in enumerate(zip(a, b)):
            _diff(u, v, f"{where}[{i}]", found)
    elif a != b and not (isinstance(a, float) and a != a and b != b):
        found.append(f"{where}: {a!r} != {b!r}")


def compare(a_path: str, b_path: str) -> int:
    a, b = torch.load(a_path, weights_only=False), torch.load(b_path, weights_only=False)
    found: list[str] = []
    _diff(a, b, "", found)
    for line in found[:50]:
        print(line)
    print(f"{len(a)} layouts compared: {len(found)} differences")
    return 1 if found else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    elif len(sys.argv) == 3 and sys.argv[1] == "resume":
        resume(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare-runs":
        sys.exit(compare_runs(sys.argv[2], sys.argv[3]))
    else:
        print("usage: residual_parity.py dump OUT.pt | compare A.pt B.pt", file=sys.stderr)
        sys.exit(2)
