"""QK-clip: Kimi K2's MuonClip rule (Kimi Team 2025, arXiv 2507.20534, Sec. 2.1, Algorithm 1), for any optimizer.

After each optimizer step, for each attention head h whose largest pre-softmax logit over the step's batch

    S_max^h = max_{X in batch} max_{j <= i} s * q_i^h . k_j^h          (s: the logit scale, 1/sqrt(d_k))

exceeded tau, the head's queries and keys are scaled so that the same batch's largest logit becomes tau:

    gamma_h = min(1, tau / S_max^h);   W_q^h <- sqrt(gamma_h) W_q^h,   W_k^h <- sqrt(gamma_h) W_k^h

Heads at or below tau are untouched (the paper's per-head rule; the logit is bilinear in the two, so the
product is scaled by exactly gamma_h). The paper's model is MLA, whose rotary key is shared by all heads: it
scales the head-specific q^R by gamma_h and leaves the shared k^R alone; so does normlab with ``attention=mla``
(q^C, k^C by sqrt(gamma_h) through W^UQ, W^UK; q^R by gamma_h through W^QR; with a q-norm or k-norm, that norm's
output per head instead, and q^R then takes only the factor the normed side does not: with a k-norm and no q-norm
q^R is scaled by sqrt(gamma_h), the k-norm's output covering k^R). With grouped-query attention a key
head is shared by the group's query heads; normlab follows Megatron-LM's `qk_clip` for GQA: each KV group
takes the largest S_max of its query heads, and that group's query heads and its key head are scaled by
sqrt(gamma_group) (a head of the group that stayed below tau is scaled too; with n_kv_heads = n_heads this
is the paper's rule exactly).

Where the logit's scale lives: without a QK-norm, in W_q / W_k (their rows of head h, and their biases).
With a QK-norm, q = g_q * N(W_q x) does not scale with W_q, so the norm's output is scaled instead: its gain
and bias (a centered gain's 1 + w). A per-head norm (``inner=head``) shares one gain across heads, so the
layer's heads are scaled by the smallest factor among them; a norm without a parameter (``l2``, ``gain=none``)
leaves that side unclippable, and the other side takes the whole gamma; with both sides unclippable the
logit is bounded by construction (|q.k| s <= s ||q|| ||k||) and nothing is done.

The per-head max comes from the training forward itself: forward hooks on the capture taps
``blocks.i.attn.q`` / ``.k`` compute it under no_grad, one query head at a time (one (B, T, T) block of logits
in memory), over every micro-batch of the step (and across DDP ranks). Its cost is one more QK^T product:
2 B H T^2 d_k FLOPs per layer, a third of attention's forward score-and-sum (4 B H T^2 d_k). Under
torch.compile the hooks run eagerly (`torch.compiler.disable`: two graph breaks per layer); with a sliding
window the max is taken over the causal logits, the window's included (an upper bound).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn

from normlab.model.attention import Attention
from normlab.model.lm import NormLM
from normlab.model.norms import gain_of, is_norm
from normlab.runs.metrics import ProbeMetric


def head_max_logits(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """(H,) float32: each query head's largest causal logit s q_i . k_j (j <= i; queries the last T of the
    keys), one head's (B, T, N) block at a time. q (B, H, T, d), k (B, Hkv, N, d)."""
    heads, kv, t, n = q.shape[1], k.shape[1], q.shape[2], k.shape[2]
    visible = torch.ones(t, n, dtype=torch.bool, device=q.device).tril(n - t)
    out = torch.empty(heads, dtype=torch.float32, device=q.device)
    with torch.autocast(q.device.type, enabled=False):  # the hooks run inside the step's autocast
        for h in range(heads):
            s = (q[:, h].float() @ k[:, h * kv // heads].float().transpose(-2, -1)) * scale
            out[h] = s.masked_fill(~visible, float("-inf")).amax()
    return out


def _scale_rows(linear: nn.Linear, factors: torch.Tensor, head_dim: int) -> None:
    """Each head's rows of W (and of its bias) times its factor; factors (heads,)."""
    w = linear.weight
    w.mul_(factors.repeat_interleave(head_dim).to(w.dtype)[:, None])
    if linear.bias is not None:
        linear.bias.mul_(factors.repeat_interleave(head_dim).to(linear.bias.dtype))


def _scale_norm_output(norm: nn.Module, factors: torch.Tensor, head_dim: int) -> bool:
    """Scale a norm's output per head (its gain and bias); False if it has no gain to scale."""
    w = getattr(norm, "weight", None)
    if gain_of(norm) is None or not isinstance(w, torch.Tensor):
        return False
    offset = getattr(norm, "offset", 0.0)
    per = factors.repeat_interleave(head_dim) if w.numel() == factors.numel() * head_dim else factors.min()
    gain = (w + offset) * per.to(w.dtype)
    w.copy_(gain - offset)
    bias = getattr(norm, "bias", None)
    if bias is not None:
        bias.mul_(per.to(bias.dtype))
    return True


Hook = Callable[[nn.Module, Any, torch.Tensor], None]


def _eager(hook: Hook) -> Hook:
    """``hook`` run eagerly under a compiled model (a graph break per tap), not traced (torch.compiler.disable)."""
    return cast(Hook, torch.compiler.disable(hook))


class QKClip:
    """The per-head max logits of each step (hooks on the taps) and the rescale after the optimizer step."""

    def __init__(self, model: NormLM, tau: float) -> None:
        self.tau = tau
        self.attns: list[Attention] = [block.attn for block in model.block_list()]
        # per layer: (H,) running max over the step's micro-batches
        self.max: list[torch.Tensor | None] = [None] * len(self.attns)
        self.interventions = 0  # head rescales (a GQA group counts each of its query heads)
        self.steps_clipped = 0
        self.largest = -math.inf  # the largest S_max seen by the rule
        self._q: dict[int, torch.Tensor] = {}
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        for i, attn in enumerate(self.attns):
            self.handles.append(attn.q.register_forward_hook(self._hook_q(i)))
            self.handles.append(attn.k.register_forward_hook(self._hook_k(i)))

    def _hook_q(self, i: int) -> Hook:
        @_eager
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            if module.training:
                self._q[i] = out.detach()

        return hook

    def _hook_k(self, i: int) -> Hook:
        @_eager
        def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
            q = self._q.pop(i, None)
            if q is None or not module.training:
                return
            attn = self.attns[i]
            scale = attn.scale if attn.scale is not None else attn.head_dim**-0.5
            with torch.no_grad():
                m = head_max_logits(q, out.detach(), scale)
                running = self.max[i]
                self.max[i] = m if running is None else torch.maximum(running, m)

        return hook

    def reset(self) -> None:
        """Before a step's forward passes."""
        self.max = [None] * len(self.attns)
        self._q.clear()

    @torch.no_grad()
    def apply(self) -> int:
        """After the optimizer step: rescale each head whose max logit exceeded tau; returns how many."""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            for m in self.max:
                if m is not None:
                    torch.distributed.all_reduce(m, op=torch.distributed.ReduceOp.MAX)
        clipped = 0
        for attn, s in zip(self.attns, self.max):
            if s is None:
                continue
            self.largest = max(self.largest, s.max().item())
            groups = s.view(attn.n_kv_heads, -1).amax(dim=1)  # MHA: one head per group
            # only a group above tau (a head whose logits are all negative has tau / S < 0: untouched)
            gamma = torch.where(groups > self.tau, self.tau / groups, torch.ones_like(groups))
            if bool((gamma >= 1.0).all()):
                continue
            rep = attn.n_heads // attn.n_kv_heads
            clipped += int((gamma < 1.0).sum().item()) * rep
            root = gamma.sqrt()
            q_side, k_side = root.repeat_interleave(rep), root
            q_ok = self._scalable(attn.q_norm)
            k_ok = self._scalable(attn.k_norm)
            if not (q_ok or k_ok):
                continue  # both sides normalized without a gain: the logit is bounded already
            if not k_ok:
                q_side = gamma.repeat_interleave(rep)
            if not q_ok:
                k_side = gamma
            if q_ok:
                # MLA without a q-norm: q^R takes the factor of the shared k^R as well (k^R is left alone)
                rope = q_side * (1.0 if is_norm(attn.k_norm) else k_side.repeat_interleave(rep))
                self._scale(attn, attn.q_proj, attn.q_norm, q_side, rope)
            if k_ok:
                self._scale(attn, attn.k_proj, attn.k_norm, k_side)
        self.interventions += clipped
        self.steps_clipped += int(clipped > 0)
        return clipped

    @staticmethod
    def _scalable(norm: nn.Module) -> bool:
        return not is_norm(norm) or gain_of(norm) is not None

    @staticmethod
    def _scale(
        attn: Attention, proj: nn.Linear, norm: nn.Module, factors: torch.Tensor, rope: torch.Tensor | None = None
    ) -> None:
        """Scale one side's logit per head: the norm's output (QK-norm), else the projection's rows of each head;
        MLA (attention=mla): W^UQ / W^UK's rows of d_h per head, and ``rope`` on W^QR's rows (the query's RoPE part)."""
        if is_norm(norm):
            _scale_norm_output(norm, factors, attn.head_dim)
            return
        nope = getattr(attn, "nope", None)
        _scale_rows(proj, factors, attn.head_dim if nope is None else nope)
        q_rope = getattr(attn, "q_rope", None)
        if nope is not None and rope is not None and isinstance(q_rope, nn.Linear):
            _scale_rows(q_rope, rope, attn.head_dim - nope)

    def summary(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "interventions": self.interventions,
            "steps_clipped": self.steps_clipped,
            ProbeMetric.MAX_LOGIT.value: self.largest if math.isfinite(self.largest) else None,
        }

    def state_dict(self) -> dict[str, Any]:
        return {"interventions": self.interventions, "steps_clipped": self.steps_clipped, "largest": self.largest}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.interventions, self.steps_clipped = int(state["interventions"]), int(state["steps_clipped"])
        self.largest = float(state["largest"])
