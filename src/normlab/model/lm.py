"""The decoder-only language model (Llama 3 style, as both Kim and Zhuo use).

    y_0 = N_emb(scale * Embed(tokens))        Kim Sec. 3.3 optional embedding norm; Gemma's sqrt(d) scale
    x_{l+1} = Block_l(x_l)                     per-layer layout from `resolve(layout, n_layers)`
    logits = Head(N_final(x_L))                Kim Sec. 3.3 final norm

With n > 1 residual streams (hyper-connections) the state x_l is the n streams side by side and x_L their sum
enters the final norm; with Attention Residuals x_l is the depth sources side by side (the embedding, then each
block's sum) and the final norm reads one more softmax read over all of them (normlab.model.depth_attention).

For large models: ``activation_checkpointing`` keeps only each block's input for the backward and
recomputes the block (`torch.utils.checkpoint`, non-reentrant), and the loss can be chunked over
tokens (`normlab.model.loss`). Generation passes a `Decoding` (positions, padding mask, KV cache).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from normlab.errors import LayoutError
from normlab.layout.sites import NORM_SITES, ResolvedLayout
from normlab.model.block import Block
from normlab.model.config import CROSS_LAYER_ATTENTION, ModelConfig
from normlab.model.decoding import Decoding, check_positions
from normlab.model.depth_attention import DepthAttention
from normlab.model.depth_value import DepthValueAttention, link_values
from normlab.model.loss import lm_loss, logits_of
from normlab.model.mla import LatentAttention
from normlab.model.moda import DepthKVAttention, link_depth
from normlab.model.moe import MoE
from normlab.model.norms import Tap, is_norm, site_norm
from normlab.model.residual import residual_path
from normlab.model.sphere import base_scale, project, rescaled
from normlab.model.storage import NO_STORAGE, Storage

# the attention kinds besides multi-head attention (ModelConfig.attention); importing them registers each in
# normlab.model.attention.ATTENTION_CLASSES, which Attention(cfg, ...) builds from
ATTENTION_SUBCLASSES = (LatentAttention, DepthKVAttention, DepthValueAttention)


@dataclass
class LMOutput:
    logits: torch.Tensor | None  # None when the loss was chunked (the logits were never whole)
    loss: torch.Tensor | None = None
    # hidden_states[0]: the stream entering block 0 (after embedding scale and norm);
    # hidden_states[i + 1]: the output of block i, before the final norm. With n > 1 residual streams
    # (hyper-connections) each is (B, T, n*d), the streams side by side; with Attention Residuals (B, T, K*d), the
    # depth slots (the embedding, then each block's sum) side by side.
    hidden_states: tuple[torch.Tensor, ...] | None = None
    # MoE models: the routers' weighted auxiliary losses (load balancing + z-loss), summed over layers;
    # the trainer adds it to `loss`, which stays the language-model loss (validation, probes).
    aux_loss: torch.Tensor | None = None


class NormLM(nn.Module):
    store: Storage = NO_STORAGE  # the activation dtype (normlab.model.storage); set_storage sets every module's
    init_scheme: str  # the init scheme it was built with (normlab.model.build sets it)

    def __init__(self, cfg: ModelConfig, resolved: ResolvedLayout) -> None:
        super().__init__()
        if resolved.n_layers != cfg.n_layers:
            raise ValueError(f"layout resolved for {resolved.n_layers} layers, model has {cfg.n_layers}")
        if (why := cfg.layout_problem(resolved)) is not None:
            raise LayoutError(why)
        self.config, self.resolved = cfg, resolved
        layout = resolved.layout
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_embed = nn.Embedding(cfg.max_seq_len, cfg.d_model) if cfg.position == "learned" else None
        self.embed_scale = math.sqrt(cfg.d_model) if layout.embed_scale else 1.0
        self.embed_norm = site_norm(layout.embed_norm, layout.norm_at("emb"), cfg.d_model, cfg)
        self.embed_out = Tap()
        # the residual path of the layout's variant (normlab.model.residual): how each sublayer's update enters the
        # state between blocks, and how the embedding enters it and the last state is read out
        self.residual = residual_path(resolved, cfg)
        self.blocks = nn.ModuleList(
            Block(cfg, blk, layout, residual_path(resolved, cfg), i) for i, blk in enumerate(resolved.blocks)
        )
        if cfg.attention == "moda":  # mixture-of-depths attention: the layers share one store of depth keys/values
            link_depth(self.blocks)
        if cfg.attention == "depth_value":  # Depth-Attention: the layers share one store of keys and mixed values
            link_values(self.blocks)
        self.final_depth: DepthAttention | None = None  # Attention Residuals' final read over depth (its model part)
        for name, part in self.residual.model_parts().items():
            setattr(self, name, part)
        self.final_norm = site_norm(layout.final_norm, layout.norm_at("final"), cfg.d_model, cfg)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        # nGPT's s_z per vocabulary entry (stored at 1/sqrt(d) for 1: normlab.model.sphere): logits s_z * W_out h
        self.sz = nn.Parameter(torch.full((cfg.vocab_size,), base_scale(cfg.d_model))) if layout.ngpt else None
        self.activation_checkpointing = False  # set by the trainer (--activation-checkpointing)
        self.output_mult = cfg.output_multiplier

    def head(self, h: torch.Tensor) -> torch.Tensor:
        """The LM head's logits W_out h; nGPT's times s_z."""
        z = self.lm_head(h)
        return z if self.sz is None else z * rescaled(self.sz, self.config.d_model).to(z.dtype)

    def set_storage(self, storage: Storage) -> None:
        """Store activations and the residual stream in ``storage``'s dtype from now on (fp16: a value
        past 65504 is inf, as in the papers' fp16 training; see normlab.model.storage)."""
        for m in self.modules():
            if hasattr(type(m), "store"):
                setattr(m, "store", storage)  # noqa: B010 - any module's class with a `store` (mypy: not on nn.Module)

    def block_list(self) -> list[Block]:
        """The blocks in order, typed (iterating the nn.ModuleList gives nn.Module)."""
        return cast("list[Block]", list(self.blocks))

    @property
    def layout(self):  # noqa: ANN201 - a Layout
        return self.resolved.layout

    def post_step_hooks(self) -> list[Callable[[], None]]:
        """What must run after every optimizer step for the model to stay the model its layout says (the optimizer
        factory registers each, normlab.train.optim): nGPT's weights put back on the unit sphere
        (normlab.model.sphere.project, Loshchilov et al. 2024 Sec. 2.6); none for any other layout."""
        return [functools.partial(project, self)] if self.layout.ngpt else []

    def norms_at_sites(self) -> dict[str, list[nn.Module]]:
        """Each norm site (`NORM_SITES`) -> the norm modules it holds, one per layer where it is on (blocks in order;
        `emb` and `final` one each): what the optimizer's per-site-kind gain policy reads."""
        out: dict[str, list[nn.Module]] = {site: [] for site in NORM_SITES}
        for b in self.blocks:
            for name, norms in (("attn", b.attn_norms), ("mlp", b.mlp_norms)):
                for letter, attr in (("A", "input"), ("B", "output"), ("C", "after_add")):
                    out[f"{name}.{letter}"].append(getattr(norms, attr))
            out["mlp.H"].append(getattr(b.mlp, "hidden_norm", nn.Identity()))
            for site, attr in (("q", "q_norm"), ("k", "k_norm"), ("v", "v_norm"), ("c", "context_norm")):
                out[site].append(getattr(b.attn, attr))
        out["emb"].append(self.embed_norm)
        out["final"].append(self.final_norm)
        return {site: [m for m in mods if is_norm(m)] for site, mods in out.items()}

    def embed_tokens(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """y_0: the stream entering block 0 (embedding, Gemma scale, embedding norm); learned absolute
        positions 0..T-1 or ``positions`` (B, T)."""
        if tokens.dim() != 2:
            raise ValueError(f"tokens must be (batch, seq), got shape {tuple(tokens.shape)}")
        x = self.embed(tokens)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if self.pos_embed is not None:
            if positions is None:
                if tokens.shape[1] > self.config.max_seq_len:
                    raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len={self.config.max_seq_len}")
                positions = torch.arange(tokens.shape[1], device=tokens.device)
            x = x + self.pos_embed(positions)
        return self.embed_out(self.store(self.embed_norm(self.store(x))))

    @property
    def streams(self) -> int:
        """The d-wide streams side by side in the state between blocks: n with hyper-connections
        (normlab.model.streams), 2 with SiameseNorm (X, Y), 1 for every other layout."""
        return self.residual.streams

    @property
    def state_width(self) -> int:
        """The width of the state between blocks: d, or n*d with n streams, or K*d with K depth slots (AttnRes)."""
        return self.residual.width(self.config.d_model)

    def expand(self, x: torch.Tensor) -> torch.Tensor:
        """y_0 (B, T, d) as the state entering block 0: n copies side by side, (B, T, n*d), with n streams (Zhu et
        al. 2025); the embedding in slot 0 and zeros after, (B, T, K*d), with Attention Residuals."""
        return self.residual.expand(x, self)

    def collapse(self, x: torch.Tensor) -> torch.Tensor:
        """The last block's state as one (B, T, d) for the final norm: the n streams summed (Zhu et al. 2025,
        Sec. 3); with Attention Residuals the final read over every slot (Kimi Team 2026, Sec. 3.2)."""
        return self.residual.collapse(x, self)

    def run_blocks(
        self, x: torch.Tensor, return_hidden_states: bool = False, decoding: Decoding | None = None
    ) -> tuple[torch.Tensor, list[torch.Tensor] | None]:
        """The blocks from a given stream x_0; optionally every block's output. With n > 1 streams x_0 (B, T, d)
        enters as n copies and every state, the output included, is (B, T, n*d) (`collapse` reads it out); with
        Attention Residuals the state is the depth slots, (B, T, K*d)."""
        if self.state_width != self.config.d_model and x.shape[-1] == self.config.d_model:
            x = self.expand(x)
        hidden = [x] if return_hidden_states else None
        # not while hidden states are returned (the probes take gradients with respect to them), nor
        # with a KV cache (the recompute would append the keys twice), nor with MoDA or Depth-Attention (their layers
        # share the depth entries of one forward, normlab.model.moda / depth_value, which a block's recompute in the
        # backward would not see)
        recompute = (
            self.activation_checkpointing
            and self.config.attention not in CROSS_LAYER_ATTENTION
            and self.training
            and torch.is_grad_enabled()
            and hidden is None
            and (decoding is None or decoding.cache is None)
        )
        for block in self.blocks:
            x = checkpoint(block, x, decoding, use_reentrant=False) if recompute else block(x, decoding)
            if hidden is not None:
                hidden.append(x)
        return x, hidden

    def forward(
        self,
        tokens: torch.Tensor,
        targets: torch.Tensor | None = None,
        return_hidden_states: bool = False,
        z_loss: float = 0.0,
        loss_chunk: int = 0,
        decoding: Decoding | None = None,
        logits_to_keep: int = 0,
    ) -> LMOutput:
        """tokens (B, T) int64 -> logits (B, T, vocab); loss if targets given (ignore_index -100),
        plus ``z_loss`` times the z-loss; ``loss_chunk`` tokens at a time if set (logits then None).
        ``decoding``: positions, padding mask and KV cache of a generation step; ``logits_to_keep``:
        the logits of the last k positions only (generation needs one)."""
        positions = decoding.positions if decoding is not None else None
        if positions is not None:
            check_positions(positions, self.config.max_seq_len)  # once here, not in every layer's RoPE
        x, hidden = self.run_blocks(self.embed_tokens(tokens, positions), return_hidden_states, decoding)
        h, softcap = (
            self.store(self.final_norm(self.collapse(x))),
            self.config.logit_softcap,
        )  # Gemma 2's logit soft-cap
        if self.output_mult != 1.0:  # muP's readout: logits = W (h / m) (normlab.model.parametrization)
            h = self.store(h * self.output_mult)
        head = self.lm_head if self.sz is None else self.head
        if logits_to_keep and targets is None:
            h = h[:, -logits_to_keep:]
        logits: torch.Tensor | None
        if targets is None:
            logits, loss = logits_of(head, h, softcap, self.store), None
        else:
            loss, logits = lm_loss(head, h, targets, softcap, z_loss, loss_chunk, self.store)
        moe = [b.mlp.aux for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.aux is not None]
        return LMOutput(
            logits=logits,
            loss=loss,
            hidden_states=tuple(hidden) if hidden is not None else None,
            aux_loss=torch.stack(moe).sum() if moe else None,
        )
