"""One residual sublayer's branch: its site norms around its function (Kim et al. 2025 Fig. 2 sites A, B, C).

`SiteNorms` holds the three d-wide norm sites of a sublayer (``input`` A, ``output`` B, ``after_add`` C; the block
registers it as ``attn_norms`` / ``mlp_norms``, the paths of the checkpoint keys and the probes) and where the
sublayer's skip comes from (x, N_A(x): Zhuo et al. 2025 eq. 9, or the block's input: SpanNorm). A `Sublayer` binds
those norms to the sublayer's function F (attention or the MLP) and its update tap, and computes the branch::

    u      = N_A(x)                                   (times 1/sqrt(l) with LayerNorm Scaling, Sun et al. 2025 eq. 6)
    update = N_B(F(u))                                (the residual scheme scales it by h and adds it: model.residual)

and the close of a sum, x' = N_C(skip + update), with the update passing the tap that probes read. Every tensor a
real fp16 run writes to memory is rounded where it is made (`Flow.store`, normlab.model.storage).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from normlab.layout.sites import Layout, SublayerSites
from normlab.model.config import ModelConfig
from normlab.model.decoding import Decoding
from normlab.model.norms import Tap, site_norm
from normlab.model.storage import Storage

if TYPE_CHECKING:
    from normlab.model.admin import AdminProfile


class SiteNorms(nn.Module):
    """The three norm sites of one sublayer: ``input`` (A), ``output`` (B), ``after_add`` (C)."""

    def __init__(self, sites: SublayerSites, layout: Layout, cfg: ModelConfig, sublayer: str) -> None:
        super().__init__()
        d = cfg.d_model
        self.input = site_norm(sites.input, layout.norm_at(f"{sublayer}.A"), d, cfg)
        self.output = site_norm(
            sites.output, layout.norm_at(f"{sublayer}.B"), d, cfg, frozen_gamma=layout.freeze_output_gamma
        )
        self.after_add = site_norm(sites.after_add, layout.norm_at(f"{sublayer}.C"), d, cfg)
        self.skip_normed = sites.skip_normed
        self.skip_block = sites.skip_block  # SpanNorm: the skip is the block's input


@dataclass
class Flow:
    """What one block's forward hands each sublayer: the activation storage, the decoding step (attention's),
    the block's input (SpanNorm's skip), and Admin's profiling pass while it runs (normlab.model.admin)."""

    store: Storage
    block_in: torch.Tensor
    decoding: Decoding | None = None
    admin: AdminProfile | None = None


class Sublayer:
    """One sublayer of a block: its site norms and its function, bound (see the module docstring). Both are modules
    the block registers under their own names (``attn_norms`` and ``attn``; ``mlp_norms`` and ``mlp``), so the
    checkpoint keys and the probes' paths are those names; this object computes with them."""

    def __init__(self, name: str, index: int, norms: SiteNorms, f: nn.Module, tap: Tap, ln_scale: float = 1.0) -> None:
        """``index``: k over the model's sublayers (2 l for layer l's attention, 2 l + 1 for its MLP)."""
        self.name, self.index, self.norms, self.f, self.tap, self.ln_scale = name, index, norms, f, tap, ln_scale

    def branch(self, x: torch.Tensor, flow: Flow) -> tuple[torch.Tensor, torch.Tensor]:
        """(N_A(x), N_B(F(N_A(x) * ln_scale))): the normed input (a skip may start there) and the update."""
        store = flow.store
        normed = store(self.norms.input(x))
        u = store(normed * self.ln_scale) if self.ln_scale != 1.0 else normed
        out: Any = self.f(u) if flow.decoding is None or self.name != "attn" else self.f(u, flow.decoding)
        return normed, store(self.norms.output(store(out)))

    def skip(self, x: torch.Tensor, normed: torch.Tensor, flow: Flow) -> torch.Tensor:
        """Where the skip starts: N_A(x) (S), the block's input (W, SpanNorm's MLP) or x."""
        return normed if self.norms.skip_normed else flow.block_in if self.norms.skip_block else x

    def close(self, skip: torch.Tensor, update: torch.Tensor, flow: Flow) -> torch.Tensor:
        """x' = N_C(skip + update), the update through the tap the probes read."""
        return flow.store(self.norms.after_add(flow.store(skip + self.tap(update))))
