"""The names of what a run records: one vocabulary, used instead of bare strings.

`Metric`: the keys of a metrics.jsonl row (normlab.train.trainer writes one per step: the loss, the learning rate,
the gradient norm before clipping, throughput, and the flags of the divergence monitor and the spike policy).
`ProbeMetric`: the ``metric`` of a probes.jsonl row (normlab.diagnostics.probes, .attach) and of the per-step
tier's layers.jsonl columns (normlab.diagnostics.tier), where a name is one the readers look up (the report's
figures, recommend's signals, the doctor's checkup, the early warnings). A name with a parameter (``gate_below_0.1``)
is its prefix with the parameter appended (`ProbeMetric.GATE_BELOW`); a learned scale's is the scale's prefix with the
statistic appended (`scale_metric`). Both are `StrEnum`: each member is its string,
so it is written to JSON and compared with a row's key as the string itself.
tests/unit/test_metric_names.py checks that every key a short training run writes is here.
"""

from __future__ import annotations

from enum import StrEnum


class Metric(StrEnum):
    """The keys of a metrics.jsonl row."""

    STEP = "step"
    LOSS = "loss"  # the step's mean training loss (the routers' auxiliary loss not included)
    LR = "lr"
    GRAD_NORM = "grad_norm"  # the global gradient norm before clipping
    TOKENS = "tokens"  # tokens trained so far
    TOK_PER_S = "tok_per_s"
    TOK_PER_S_PER_DEVICE = "tok_per_s_per_device"
    TIME = "time"  # wall seconds so far
    MOE_AUX_LOSS = "moe_aux_loss"
    MFU = "mfu"  # model FLOPs utilization (normlab.train.mfu), where the device's peak is known
    LOSS_SCALE = "loss_scale"  # fp16's gradient scale
    SPIKE = "spike"  # a spike's verdict: data | dynamics | hardware (normlab.train.spikes)
    SKIPPED = "skipped"  # the update was not applied (a non-finite gradient, or the spike policy)
    OVERFLOW = "overflow"  # fp16: the scaled gradients overflowed; the scale halves
    LOSS_SPIKE = "loss_spike"  # the divergence monitor's rules (normlab.train.divergence)
    GRAD_SPIKE = "grad_spike"
    MEGATRON_SPIKE = "megatron_spike"
    VAL_LOSS = "val_loss"
    VAL_PPL = "val_ppl"


class ProbeMetric(StrEnum):
    """The ``metric`` of a probes.jsonl row (and a per-step tier column) that readers look up by name."""

    # the stream and the taps (hidden_stats)
    MEAN_ABS = "mean_abs"
    RMS = "rms"
    VAR = "var"
    MAX_ABS = "max_abs"
    KURTOSIS = "kurtosis"
    TOP100_MAX = "top100_max"
    TOP100_MEAN = "top100_mean"
    TOP100_MIN = "top100_min"
    MEDIAN_ABS = "median_abs"
    MAX_MEDIAN_RATIO = "max_median_ratio"
    FP16_HEADROOM = "fp16_headroom"
    ANGULAR_DISTANCE = "angular_distance"
    ANGULAR_DISTANCE_ALL = "angular_distance_all"
    ANGULAR_NEXT = "angular_next"
    # weights, gradients and updates
    GRAD_NORM = "grad_norm"
    GRAD_MAX = "grad_max"
    WEIGHT_NORM = "weight_norm"
    UPDATE_NORM = "update_norm"
    UPDATE_RATIO = "update_ratio"
    EXP_AVG_NORM = "exp_avg_norm"
    EXP_AVG_SQ_NORM = "exp_avg_sq_norm"
    # attention
    MAX_LOGIT = "max_logit"
    ENTROPY = "entropy"
    SINK_MASS = "sink_mass"
    SINK_RATE = "sink_rate"
    GATE_MEAN = "gate_mean"
    GATE_BELOW = "gate_below_"  # + the cut: gate_below_0.1, gate_below_0.01, gate_below_0.001
    # norms and learned scalars
    GAMMA_MEAN = "gamma_mean"
    GAMMA_MIN = "gamma_min"
    GAMMA_MAX = "gamma_max"
    ALPHA = "alpha"
    SHIFT = "shift"
    SATURATED_SHARE = "saturated_share"
    # a learned scale that is not a norm (normlab.model.block.SCALE_PARAMS): its prefix, then the statistic
    SCALE_MEAN = "_mean"  # h_mean, omega_mean, head_scale_mean, ...
    SCALE_ABS_MAX = "_abs_max"
    # Kim Prop. 3.1 (the last dense MLP), hyper-connections, mixture of experts, the probe's own loss
    H_NORM = "h_norm"
    A_NORM = "a_norm"
    TOK_H_NORM = "tok_h_norm"
    TOK_A_NORM = "tok_a_norm"
    TOK_GRAD_MAX = "tok_grad_max"
    TOK_GRAD_MEAN = "tok_grad_mean"
    GRAD_H_SLOPE = "grad_h_slope"
    GRAD_H_CORR = "grad_h_corr"
    TOK_BOUND = "tok_bound"  # the per-token bound 4 gamma sqrt(D) ||h_t|| / ||a_t|| (normlab.diagnostics.prop31)
    TOK_WITHIN_BOUND = "tok_within_bound"  # the share of tokens whose gradient entry is within it
    BOUND = "bound"
    PRE_MEAN = "pre_mean"
    POST_MEAN = "post_mean"
    RES_DIAG_MEAN = "res_diag_mean"
    RES_ROW_SUM_MAX = "res_row_sum_max"
    RES_COL_SUM_MAX = "res_col_sum_max"
    COMPOSITE_GAIN_FORWARD = "composite_gain_forward"
    COMPOSITE_GAIN_BACKWARD = "composite_gain_backward"
    LOAD = "load"
    LOAD_MAX_RATIO = "load_max_ratio"
    ROUTER_ENTROPY = "router_entropy"
    AUX_LOSS = "aux_loss"
    PROBE_LOSS = "probe_loss"
    # the per-step tier's columns besides grad_norm, max_logit and update_ratio (normlab.diagnostics.tier)
    MAX_LOGIT_BOUND = "max_logit_bound"
    STREAM_MAX = "stream_max"
    UPDATE_RMS = "update_rms"


def scale_metric(prefix: str, statistic: ProbeMetric) -> str:
    """A learned scale's probe metric: its prefix (``normlab.model.block.SCALE_PARAMS``) and the statistic
    (`ProbeMetric.SCALE_MEAN`, `ProbeMetric.SCALE_ABS_MAX`): ``h_mean``."""
    return prefix + statistic


def known_probe_metric(name: str) -> bool:
    """Whether ``name`` is a `ProbeMetric`, a parametrized one (its prefix and the parameter), or a learned scale's
    (a prefix of ``normlab.model.block.SCALE_PARAMS`` and a statistic)."""
    if name in {m.value for m in ProbeMetric}:
        return True
    if any(m.endswith("_") and name.startswith(m) for m in ProbeMetric):
        return True
    from normlab.model.block import SCALE_PARAMS  # the model's facts, read when asked (no import at load)

    stats = (ProbeMetric.SCALE_MEAN, ProbeMetric.SCALE_ABS_MAX)
    return any(name == scale_metric(prefix, s) for prefix in set(SCALE_PARAMS.values()) for s in stats)
