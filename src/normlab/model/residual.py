"""The residual path of a model: one class per variant of normlab.layout.residual, chosen at build time.

`residual_path` looks the layout's variant up in `RESIDUALS` (variant type -> class) and makes the one object a
`NormLM` keeps (``model.residual``). It says how each sublayer's update enters the state between blocks (`write`),
what learned pieces each sublayer has (`parts`: the block registers them under ``attn_<part>`` / ``mlp_<part>``, the
checkpoint keys and the probes' paths), and, for schemes whose state is wider than one stream, how the embedding
enters it and how the last block's state is read out (`expand`, `collapse`, `width`, `model_parts`).

    SkipPath      x' = N_C(alpha lambda omega skip + h N_B(F(N_A(x)))), then GPAS          (layout Skip)
    StreamsPath   h_0 = pre . H;  H' = res H + post * h N_B(F(N_A(h_0)))                   (layout Streams)
    AttnResPath   h_l = sum_i alpha_i v_i over the depth slots; b_n <- b_n + h N_B(F(N_A(h_l)))   (layout AttnRes)
    SpherePath    h <- N_C((1 - a) h + a N_B(F(h)))                                        (layout Sphere: nGPT)
    SiamesePath   X' = N_X(X) + O / c, Y' = Y + O, O = N_B(F(N_A(N_X(X) + N_Y(Y))))      (layout Siamese)

Each class's docstring gives its equations and sources. A new residual design is one variant in
normlab.layout.residual and one class here, added to `RESIDUALS` with `register`.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, cast

import torch
from torch import nn

from normlab.layout.residual import ADMIN, AttnRes, Residual, Siamese, Skip, Sphere, Streams
from normlab.layout.sites import NormSpec, ResolvedLayout
from normlab.model.config import ModelConfig
from normlab.model.depth_attention import DepthAttention, add_to_slot, block_of, first_state, n_slots, n_sources
from normlab.model.norms import site_norm
from normlab.model.sphere import base_scale, eigen
from normlab.model.storage import Storage
from normlab.model.streams import connection
from normlab.model.sublayer import Flow, Sublayer

Part = nn.Parameter | nn.Module | None
SUBLAYERS = ("attn", "mlp")


class ResidualPath:
    """How the sublayers of one model write to the stream, for one residual variant (see the module docstring).

    The base is the branch step shared by the schemes that have one: update <- h update (a learned ``h`` part
    where the layout learns it: ReZero's scalar, LayerScale's channels), then CompleteP's branch multiplier."""

    variant: ClassVar[type[Residual]] = Residual
    # the learned pieces of each sublayer, in the order the block registers them (checkpoint keys and their order)
    part_names: ClassVar[tuple[str, ...]] = ("h",)
    # the d-wide streams side by side in the state between blocks, each a stream the probes read on its own
    streams = 1

    def __init__(self, resolved: ResolvedLayout, cfg: ModelConfig) -> None:
        self.layout, self.cfg, self.n_layers = resolved.layout, cfg, resolved.n_layers
        self.h = float(resolved.layout.residual.h)
        # CompleteP's residual branch multiplier (L / L_base)^-alpha; 1 under sp and mup (model.parametrization)
        self.branch = cfg.branch_multiplier

    def parts(self, k: int) -> dict[str, Part]:
        """Sublayer k's learned pieces (k = 2 l for layer l's attention, 2 l + 1 for its MLP), by part name."""
        learned = self.layout.residual.h_learned
        if learned is None:
            return {"h": None}
        shape = (1,) if learned == "scalar" else (self.cfg.d_model,)
        return {"h": nn.Parameter(torch.full(shape, self.h))}

    def update(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> tuple[torch.Tensor, ...]:
        """(N_A(x), h * N_B(F(N_A(x))) * branch): the normed input and the update this scheme adds."""
        store = flow.store
        normed, update = sub.branch(x, flow)
        h = own.get("h")
        # h and the multiplier are 1 in most layouts; skipping the multiply then saves an elementwise pass
        if h is not None:
            update = store(h.to(update.dtype) * update)
        elif self.h != 1.0:
            update = store(self.h * update)
        if self.branch != 1.0:
            update = store(self.branch * update)
        return normed, update

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        """The state after sublayer ``sub``, from the state ``x`` before it (``own``: its parts)."""
        raise NotImplementedError

    # --- the model's state between blocks ---

    def width(self, d: int) -> int:
        """The width of the state between blocks (d: one stream)."""
        return d

    def model_parts(self) -> dict[str, nn.Module | None]:
        """Learned pieces of the whole model (registered on the NormLM under these names)."""
        return {}

    def expand(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """The state entering block 0 from the embedding's y_0 (B, T, d)."""
        return x

    def collapse(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        """The last block's state as one (B, T, d) for the final norm."""
        return x


class SkipPath(ResidualPath):
    """The residual sum (layout `Skip`): x' = N_C(alpha lambda omega skip + update), skip = x, N_A(x) (Zhuo et al.
    2025 eq. 9) or the block's input (SpanNorm), then GPAS x' <- x' - SiLU(a) sg(x') (Chen et al. 2025, arXiv
    2506.22049, Sec. 3; the authors' GPASBlock: the forward scales x' by 1 - SiLU(a), the backward passes dL/dx'
    unchanged). alpha: DeepNorm's (2N)^(1/4), Keel's 2N or a number; omega: Admin's learned skip scale per channel
    (Liu et al. 2020 eq. 7, set by the profiling pass of normlab.model.admin); lambda: a learned scalar from 1
    (modded-nanogpt's residual lambdas)."""

    variant = Skip
    part_names = ("h", "omega", "skip", "gpas")

    def __init__(self, resolved: ResolvedLayout, cfg: ModelConfig) -> None:
        super().__init__(resolved, cfg)
        self.alpha = float(resolved.alpha)

    def parts(self, k: int) -> dict[str, Part]:
        v = self.layout.residual
        assert isinstance(v, Skip)
        d = self.cfg.d_model
        return {
            **super().parts(k),
            "omega": nn.Parameter(torch.ones(d)) if v.alpha == ADMIN else None,
            "skip": nn.Parameter(torch.ones(1)) if v.skip_learned else None,
            "gpas": nn.Parameter(torch.zeros(1)) if v.gpas else None,
        }

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        store = flow.store
        normed, update = self.update(x, sub, own, flow)
        skip = sub.skip(x, normed, flow)
        if self.alpha != 1.0:
            skip = store(self.alpha * skip)
        omega, lam, gpas = own["omega"], own["skip"], own["gpas"]
        if omega is not None:
            if flow.admin is not None:
                flow.admin.set(omega, skip, update)
            skip = store(omega.to(skip.dtype) * skip)
        if lam is not None:
            skip = store(lam.to(skip.dtype) * skip)
        out = sub.close(skip, update, flow)
        if gpas is not None:
            out = store(out - nn.functional.silu(gpas).to(out.dtype) * out.detach())
        return out


class SpherePath(ResidualPath):
    """nGPT's step (layout `Sphere`; Loshchilov et al. 2024 eqs. 10-11): h <- Norm((1 - a) h + a Norm(F(h))), the
    Norms the layout's sites B and C (l2), a = |a_stored a_init / a_scale| per channel (normlab.model.sphere)."""

    variant = Sphere
    part_names = ("eigen",)

    def parts(self, k: int) -> dict[str, Part]:
        d = self.cfg.d_model
        return {"eigen": nn.Parameter(torch.full((d,), base_scale(d)))}

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        store = flow.store
        _, update = self.update(x, sub, own, flow)
        eig = own["eigen"]
        a = eigen(eig, eig.shape[0]).to(update.dtype)
        return sub.close(store((1 - a) * x), store(a * update), flow)


class StreamsPath(ResidualPath):
    """n residual streams (layout `Streams`; Zhu et al. 2025 eq. 3, Xie et al. 2025 eqs. 7-8): the state is the n
    streams side by side (B, T, n*d); the branch reads h_0 = sum_j pre_j H_j and H'_i = sum_j res_ij H_j + post_i
    update (normlab.model.streams). The embedding enters as n copies; the last streams are summed (Zhu et al.
    Sec. 3)."""

    variant = Streams
    part_names = ("h", "hc")

    def __init__(self, resolved: ResolvedLayout, cfg: ModelConfig) -> None:
        super().__init__(resolved, cfg)
        self.streams = resolved.layout.streams

    def parts(self, k: int) -> dict[str, Part]:
        v = self.layout.residual
        assert isinstance(v, Streams)
        return {**super().parts(k), "hc": connection(v.mix, v.n, self.cfg.d_model, k)}

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        hc = own["hc"]
        streams = x.unflatten(-1, (hc.n, -1))
        h0, res, post = hc(streams)
        _, update = self.update(flow.store(h0), sub, own, flow)
        return flow.store(hc.depth(streams, res, post, sub.tap(update)).flatten(-2))

    def width(self, d: int) -> int:
        return d * self.layout.streams

    def expand(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return x.repeat(*([1] * (x.dim() - 1)), self.layout.streams)

    def collapse(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return x.unflatten(-1, (self.layout.streams, -1)).sum(-2)


class AttnResPath(ResidualPath):
    """Attention Residuals (layout `AttnRes`; Kimi Team 2026, arXiv 2603.15031, eqs. 2-6): the state is the depth
    slots side by side (B, T, K*d: the embedding and the blocks' sums); a sublayer reads h_l = sum_i alpha_i v_i over
    its first slots and adds its update to its block's slot; a final read over every slot feeds the final norm
    (normlab.model.depth_attention)."""

    variant = AttnRes
    part_names = ("h", "depth")

    def __init__(self, resolved: ResolvedLayout, cfg: ModelConfig) -> None:
        super().__init__(resolved, cfg)
        self.size = resolved.attn_res_size
        self.slots = n_slots(cfg.n_layers, self.size)

    def parts(self, k: int) -> dict[str, Part]:
        cfg = self.cfg
        read = DepthAttention(
            cfg.d_model, cfg.norm_eps, n_sources(k, self.size), block_of(k, self.size)[0], cfg.norm_compute
        )
        return {**super().parts(k), "depth": read}

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        depth = own["depth"]
        _, update = self.update(flow.store(depth(x)), sub, own, flow)
        assert depth.slot is not None
        return flow.store(add_to_slot(x, sub.tap(update), depth.slot))

    def width(self, d: int) -> int:
        return d * self.slots

    def model_parts(self) -> dict[str, nn.Module | None]:
        # "the final output layer aggregates all N block representations" (Kimi Team 2026 Sec. 3.2)
        cfg = self.cfg
        return {"final_depth": DepthAttention(cfg.d_model, cfg.norm_eps, self.slots, None, cfg.norm_compute)}

    def expand(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return first_state(x, self.slots)

    def collapse(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return model.store(model.final_depth(x))  # type: ignore[operator]


class SiamesePath(ResidualPath):
    """SiameseNorm (layout `Siamese`; arXiv 2602.08064): the state is the two streams side by side, (B, T, 2d), X
    (Post-Norm-like) then Y (Pre-Norm-like). The authors' code, line by line (deit-model-siamesenorm.py, Block.forward
    and VisionTransformer.forward_features; c is also OLMo_model_hybrid_pre.py's), for sublayer F of block l::

        x = post_norm(x)                      X^ = N_X(X)                   (the part ``xnorm``)
        z = input_norm(x + pre_norm(y))       u = N_A(X^ + N_Y(Y))          (``ynorm``; N_A the layout's site A)
        z = F(z)                              O = N_B(F(u))                 (site B where the layout puts one)
        x, y = x + z / c, y + z               X' = X^ + O / c,  Y' = Y + O,  c = sqrt(2 (l + 1))

    Both streams start as the embedding (``y = x.clone()``); the model reads N_final(N_x(X_L) + N_y(Y_L))
    (``final_norm(pre_norm(x) + post_norm(y))``; the parts ``final_xnorm``, ``final_ynorm``). Every norm is the
    layout's kind and gain. The update tap holds O, what Y adds."""

    variant = Siamese
    part_names = ("xnorm", "ynorm")
    streams = 2  # X, Y

    def __init__(self, resolved: ResolvedLayout, cfg: ModelConfig) -> None:
        super().__init__(resolved, cfg)
        self.spec = NormSpec(kind=self.layout.norm, gain=self.layout.gain)

    def _norm(self) -> nn.Module:
        return site_norm(True, self.spec, self.cfg.d_model, self.cfg)

    def parts(self, k: int) -> dict[str, Part]:
        return {"xnorm": self._norm(), "ynorm": self._norm()}

    def write(self, x: torch.Tensor, sub: Sublayer, own: dict[str, Any], flow: Flow) -> torch.Tensor:
        store, d = flow.store, self.cfg.d_model
        xs, ys = x[..., :d], x[..., d:]
        xs = store(own["xnorm"](xs))
        _, update = self.update(store(xs + store(own["ynorm"](ys))), sub, own, flow)
        update = sub.tap(update)
        c = math.sqrt(2 * (sub.index // 2 + 1))
        return torch.cat([store(xs + update / c), store(ys + update)], dim=-1)

    def width(self, d: int) -> int:
        return 2 * d

    def model_parts(self) -> dict[str, nn.Module | None]:
        return {"final_xnorm": self._norm(), "final_ynorm": self._norm()}

    def expand(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        return torch.cat([x, x], dim=-1)

    def collapse(self, x: torch.Tensor, model: nn.Module) -> torch.Tensor:
        d = self.cfg.d_model
        nx, ny = (cast(nn.Module, getattr(model, name)) for name in ("final_xnorm", "final_ynorm"))
        store = cast(Storage, model.store)
        return store(store(nx(x[..., :d])) + store(ny(x[..., d:])))


# variant type -> the class that computes it
RESIDUALS: dict[type[Residual], type[ResidualPath]] = {}


def register(path: type[ResidualPath]) -> type[ResidualPath]:
    """Add a residual class for its ``variant`` (usable as a class decorator); its part names join `PART_NAMES`."""
    RESIDUALS[path.variant] = path
    for name in path.part_names:
        if name not in PART_NAMES:
            PART_NAMES.append(name)
    return path


# every part name of every registered class: a block sets those of the other schemes to None (so ``block.attn_hc``
# reads None under a single stream: init, the screen and the probes ask that)
PART_NAMES: list[str] = []
for _path in (SkipPath, SpherePath, StreamsPath, AttnResPath, SiamesePath):
    register(_path)


def residual_path(resolved: ResolvedLayout, cfg: ModelConfig) -> ResidualPath:
    """The residual class of the layout's variant, made for this model."""
    kind = type(resolved.layout.residual)
    if kind not in RESIDUALS:
        raise TypeError(f"no residual class is registered for {kind.__name__} (normlab.model.residual.register)")
    return RESIDUALS[kind](resolved, cfg)
