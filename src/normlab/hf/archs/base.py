"""What one transformers architecture must say to be converted exactly: the adapter every entry of
`normlab.hf.archs.ARCHITECTURES` is.

An adapter names the normlab preset its class computes, builds the transformers config for a normlab
model (export) and the normlab `ModelConfig` for a transformers config (import), maps parameter
names both ways, transforms weights where the two parametrize a norm differently, and lists every
config or model option that would make the two compute different functions (a conversion that
silently changed the function would be worse than none).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from normlab.model.config import MlpKind, ModelConfig

if TYPE_CHECKING:
    import torch


def window_of(config: Any) -> tuple[int | None, int]:
    """A transformers config's attention windows as normlab's (sliding_window, full_attention_every).

    ``layer_types`` (transformers 5: "sliding_attention" / "full_attention" per layer) decides where it
    is given; else a set ``sliding_window`` windows every layer (Mistral). A pattern other than "every
    layer", "none" or "every k-th layer full" (Gemma 3, OLMo 3) is refused by name.
    """
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:
        return (window, 0) if window else (None, 0)
    sliding = [t == "sliding_attention" for t in types]
    if not any(sliding):
        return None, 0
    if not window:
        raise ValueError("layer_types has sliding layers but sliding_window is not set")
    if all(sliding):
        return window, 0
    full = [i for i, s in enumerate(sliding) if not s]
    k = full[0] + 1
    if all(s == ((i + 1) % k != 0) for i, s in enumerate(sliding)):
        return window, k
    raise ValueError(f"layer_types {types} is not 'every k-th layer full' (normlab's full_attention_every)")


class Arch:
    """The adapter of one transformers architecture (subclasses fill in the class attributes and maps)."""

    model_type: str = ""  # transformers' config.model_type
    name: str = ""  # the name `--arch` takes, where it is not model_type (gemma3 for gemma3_text)
    preset: str = ""  # the normlab layout preset it computes
    mlp: MlpKind = "swiglu"  # the MLP it computes
    exports: bool = True  # normlab -> transformers too (False: import only)
    activation: str = "silu"  # the config's activation name for `mlp`
    activation_key: str = "hidden_act"
    options: tuple[str, ...] = ()  # of attn_scale, attn_softcap, logit_softcap: the ones the class computes (Gemma)
    windows: bool = False  # whether the class has sliding-window attention (its config's sliding_window)
    qkv_bias: bool = False  # whether its q, k, v projections have biases (Qwen 2)
    window_patterns: bool = False  # whether it mixes windowed and global layers (layer_types)
    local_rope: bool = False  # whether its windowed layers may have a RoPE base of their own
    # normlab's model option -> the config.json key that states it (what a refusal names)
    config_keys: dict[str, str] = {
        "vocab_size": "vocab_size",
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "n_heads": "num_attention_heads",
        "n_kv_heads": "num_key_value_heads",
        "d_head": "head_dim",
        "d_ff": "intermediate_size",
        "max_seq_len": "max_position_embeddings",
        "rope_theta": "rope_parameters rope_theta",
        "rope_local_theta": "rope_parameters sliding_attention rope_theta",
        "norm_eps": "rms_norm_eps",
        "tie_embeddings": "tie_word_embeddings",
        "sliding_window": "sliding_window",
        "full_attention_every": "layer_types",
        "qkv_bias": "attention_bias",
        "attn_scale": "query_pre_attn_scalar",
        "attn_softcap": "attn_logit_softcapping",
        "logit_softcap": "final_logit_softcapping",
    }

    # -- export: normlab -> transformers --
    def model_problems(self, cfg: ModelConfig) -> list[str]:
        """Model options this class does not compute (beyond the layout, which the caller checks)."""
        problems = []
        if cfg.mlp != self.mlp:
            problems.append(f"mlp={cfg.mlp} (needs {self.mlp})")
        if cfg.linear_bias:
            problems.append("linear_bias=True (needs no biases)")
        if cfg.qkv_bias and not self.qkv_bias:
            problems.append("qkv_bias=True (this class has no q/k/v biases)")
        if self.qkv_bias and not cfg.qkv_bias:
            problems.append("qkv_bias=False (this class has q/k/v biases)")
        if cfg.position != "rope":
            problems.append(f"position={cfg.position} (needs rope)")
        for name in ("attn_scale", "attn_softcap", "logit_softcap"):
            if getattr(cfg, name) is not None and name not in self.options:
                problems.append(f"{name}={getattr(cfg, name)} (needs None)")
        if "attn_scale" in self.options and cfg.attn_scale is not None and cfg.attn_scale != int(cfg.attn_scale):
            problems.append(f"attn_scale={cfg.attn_scale} (the config's query_pre_attn_scalar is an integer)")
        if cfg.sliding_window is not None and not self.windows:
            problems.append(f"sliding_window={cfg.sliding_window} (this class has no sliding-window attention)")
        if cfg.full_attention_every and self.windows and not self.window_patterns:
            problems.append(f"full_attention_every={cfg.full_attention_every} (this class windows every layer)")
        if cfg.rope_local_theta is not None and not self.local_rope:
            problems.append(f"rope_local_theta={cfg.rope_local_theta} (this class has one RoPE base)")
        return problems

    def hf_config(self, tf: Any, cfg: ModelConfig) -> Any:
        raise NotImplementedError

    def window_fields(self, cfg: ModelConfig) -> dict[str, Any]:
        """The config fields of a class that mixes windowed and global layers (`window_patterns`): the window
        (without one every layer is global, with the nominal window transformers requires), the layer types,
        and per-type RoPE where the class has it (`local_rope`)."""
        fields = {"sliding_window": cfg.sliding_window or cfg.max_seq_len, "layer_types": self.layer_types(cfg)}
        if self.local_rope:
            fields["rope_parameters"] = self.rope_by_layer_type(cfg)
        return fields

    @staticmethod
    def rope_by_layer_type(cfg: ModelConfig) -> dict[str, dict]:
        """transformers 5's per-layer-type RoPE settings for a normlab config."""
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        return {
            "full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
            "sliding_attention": {"rope_type": "default", "rope_theta": local},
        }

    @staticmethod
    def layer_types(cfg: ModelConfig) -> list[str]:
        """transformers' per-layer attention kinds for a normlab config."""
        return ["full_attention" if cfg.window_of(i) is None else "sliding_attention" for i in range(cfg.n_layers)]

    def hf_class(self, tf: Any) -> Any:
        raise NotImplementedError

    @staticmethod
    def common_config(cfg: ModelConfig) -> dict[str, Any]:
        """The config fields Llama-family classes share."""
        return dict(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.d_model,
            intermediate_size=cfg.ffn_dim,
            num_hidden_layers=cfg.n_layers,
            num_attention_heads=cfg.n_heads,
            num_key_value_heads=cfg.kv_heads,
            head_dim=cfg.head_dim,
            max_position_embeddings=cfg.max_seq_len,
            rms_norm_eps=cfg.norm_eps,
            rope_parameters={"rope_type": "default", "rope_theta": cfg.rope_theta},
            tie_word_embeddings=cfg.tie_embeddings,
            attention_bias=False,
            hidden_act="silu",
        )

    # normlab's norm sites in a block -> the transformers modules that hold the same weights
    norm_names: dict[str, str] = {}

    def layer_map(self, i: int) -> dict[str, str]:
        """normlab parameter name -> transformers parameter name, for block i: the Llama-family projection
        names and the architecture's norms (`norm_names`)."""
        n, h = f"blocks.{i}.", f"model.layers.{i}."
        m = {f"{n}attn.{p}_proj.weight": f"{h}self_attn.{p}_proj.weight" for p in "qkvo"}
        if self.qkv_bias:
            m.update({f"{n}attn.{p}_proj.bias": f"{h}self_attn.{p}_proj.bias" for p in "qkv"})
        m.update({f"{n}mlp.{p}_proj.weight": f"{h}mlp.{p}_proj.weight" for p in ("gate", "up", "down")})
        m.update({f"{n}{ours}.weight": f"{h}{theirs}.weight" for ours, theirs in self.norm_names.items()})
        return m

    def name_map(self, n_layers: int, tied: bool) -> dict[str, str]:
        m = {"embed.weight": "model.embed_tokens.weight", "final_norm.weight": "model.norm.weight"}
        if not tied:
            m["lm_head.weight"] = "lm_head.weight"
        for i in range(n_layers):
            m.update(self.layer_map(i))
        return m

    def export_weight(self, name: str, value: torch.Tensor) -> torch.Tensor:
        """A normlab weight as this class stores it (under its transformers name)."""
        return value

    # -- import: transformers -> normlab --
    def config_problems(self, config: Any) -> list[str]:
        """Config fields that ask for something normlab does not compute."""
        problems = list(self.rope_bases(config)[1])
        act = getattr(config, self.activation_key, None)
        if act != self.activation:
            problems.append(f"activation {act!r} (needs {self.activation})")
        if (getattr(config, "attention_bias", False) and not self.qkv_bias) or getattr(config, "mlp_bias", False):
            problems.append("biases on projections")
        try:
            window_of(config)
        except ValueError as err:
            problems.append(str(err))
        return problems

    def rope_bases(self, config: Any) -> tuple[dict[str, float], list[str]]:
        """The RoPE base of each layer type, as transformers computes with it, and what normlab does not compute.

        The class's own rotary embedding is built from ``config`` (transformers' `*RotaryEmbedding`: one table
        for every layer, keyed "", or one per layer type present, "full_attention" / "sliding_attention", where the
        class keeps them: Gemma 3, OLMo 3). Each base is read where that embedding's
        `compute_default_rope_parameters` reads it (``rope_parameters[type]["rope_theta"]`` or
        ``rope_parameters["rope_theta"]``, after transformers filled in its defaults: a flat ``rope_parameters``
        in an OLMo 3 config leaves OLMo 3's 500,000 on both types, whatever its own ``rope_theta`` says), and
        its inverse frequencies are checked against normlab's base^(-2i/d) (`normlab.model.rope`, Su et al.
        2021): a scaled or partial RoPE, or a type normlab does not compute, is a problem by name.
        """
        import sys

        import torch

        from normlab.hf.library import require_transformers

        cls = self.hf_class(require_transformers())
        name = cls.__name__.removesuffix("ForCausalLM") + "RotaryEmbedding"
        rotary_class = getattr(sys.modules[cls.__module__], name, None)
        if rotary_class is None:
            return {"": 10_000.0}, [f"{cls.__name__}'s module has no {name} for normlab to read its RoPE from"]
        try:
            rotary = rotary_class(config)
        except (KeyError, TypeError, ValueError, AttributeError) as err:
            return {"": 10_000.0}, [f"transformers cannot build {name} from this config ({type(err).__name__}: {err})"]
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        by_type = getattr(rotary, "layer_types", None)
        tables = (
            {
                t: (
                    config.rope_parameters[t],
                    rotary.rope_type[t],
                    getattr(rotary, f"{t}_inv_freq"),
                    getattr(rotary, f"{t}_attention_scaling"),
                )
                for t in by_type
            }
            if by_type
            else {"": (config.rope_parameters, rotary.rope_type, rotary.inv_freq, rotary.attention_scaling)}
        )
        bases, problems = {}, []
        for kind, (params, rope_type, inv_freq, scaling) in tables.items():
            bases[kind] = base = float(params["rope_theta"])
            where = f" on {kind} layers" if kind else ""
            if rope_type != "default":
                problems.append(f"rope_type {rope_type!r}{where} (normlab implements default RoPE, no scaling)")
                continue
            ours = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
            if inv_freq.shape != ours.shape or scaling != 1.0 or not torch.allclose(inv_freq.double(), ours, rtol=1e-6):
                problems.append(
                    f"RoPE{where} that is not base^(-2i/d) over the whole head for rope_theta={base:g} (a partial "
                    "rotary factor or a scaling; normlab rotates every dimension with the plain frequencies)"
                )
        return bases, problems

    def model_config(self, config: Any) -> ModelConfig:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        window, every = window_of(config)
        bases = self.rope_bases(config)[0]
        theta = bases.get("full_attention", bases.get("", bases.get("sliding_attention", 10_000.0)))
        local = bases.get("sliding_attention", theta)
        return ModelConfig(
            vocab_size=config.vocab_size,
            d_model=config.hidden_size,
            n_layers=config.num_hidden_layers,
            n_heads=config.num_attention_heads,
            n_kv_heads=config.num_key_value_heads,
            d_ff=config.intermediate_size,
            d_head=None if head_dim * config.num_attention_heads == config.hidden_size else head_dim,
            qkv_bias=self.qkv_bias,
            sliding_window=window,
            full_attention_every=every,
            mlp=self.mlp,
            max_seq_len=config.max_position_embeddings,
            rope_theta=theta,
            rope_local_theta=local if window is not None and local != theta else None,
            norm_eps=config.rms_norm_eps,
            tie_embeddings=bool(config.tie_word_embeddings),
        )

    def import_state(self, theirs: dict[str, torch.Tensor], config: Any) -> dict[str, torch.Tensor]:
        """Their state dict as normlab's (float32), through the name map and `import_weight`."""
        mapping = self.name_map(config.num_hidden_layers, bool(config.tie_word_embeddings))
        state = {k: self.import_weight(v, theirs[v].float()) for k, v in mapping.items()}
        if config.tie_word_embeddings:
            state["lm_head.weight"] = state["embed.weight"]
        return state

    def import_weight(self, their_name: str, value: torch.Tensor) -> torch.Tensor:
        return value
