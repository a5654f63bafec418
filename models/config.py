"""What a checkpoint says about its model's shape, read from config.json or GGUF metadata: one config for
every family, whose fields a family leaves at their defaults where it lacks the feature."""

import dataclasses
from collections.abc import Callable, Collection, Mapping
from typing import Any

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types

# traits(architecture, source): the fields that architecture fixes, ValueError naming the file `source`
# where it is not supported. The readers below take it from their caller (registry.traits, passed by
# the loader) because the registry imports the model classes, and they import this module.
Traits = Callable[[str, str], Mapping[str, Any]]


def _with_traits(fixed: Mapping[str, Any], stated: dict[str, Any]) -> dict[str, Any]:
    """The fields a file states, over the architecture's `fixed` traits: a trait (else the field's
    default) is used where the file says nothing (None) of that field, or has no such field at all
    (Qwen2's q/k/v biases, Mixtral's renormalised top k)."""
    return dict(fixed) | {key: value for key, value in stated.items() if value is not None}


# Sliding layers where a file does not list them: every second layer full in Gemma 2, every sixth in
# Gemma 3 (llama.cpp fixes these in its code, not in the file, unless a GGUF has
# {arch}.attention.sliding_window_pattern: that period, or a flag per layer, true where it slides).
_SLIDING_PATTERN = {"gemma2": 2, "gemma3": 6}
# Gemma's GGUF files hold no query_pre_attn_scalar: llama.cpp takes head_dim, but hidden / heads for the
# 27B models (by their layer counts), as their config.json says.
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}


@dataclasses.dataclass(frozen=True, slots=True)
class Llama3RopeScaling:
    """Llama 3.1's rope_type "llama3": low frequencies slowed by `factor`, a smooth ramp in between."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def __post_init__(self):
        if self.factor < 1.0:
            raise ValueError(f"llama3 rope factor must be >= 1, got {self.factor}")
        if not 0 < self.low_freq_factor < self.high_freq_factor:
            raise ValueError(
                f"llama3 rope needs 0 < low_freq_factor < high_freq_factor, "
                f"got {self.low_freq_factor}, {self.high_freq_factor}"
            )
        if self.original_max_position_embeddings <= 0:
            raise ValueError("llama3 rope original_max_position_embeddings must be positive")


@dataclasses.dataclass(frozen=True, slots=True)
class ModelConfig:
    """A decoder: GQA attention with rotary embeddings, RMSNorm, a gated MLP; the fields after
    eos_token_ids are the features of families past Llama."""

    architecture: str  # a name in registry.ARCHITECTURES
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2 has biases on its q/k/v projections
    rope_scaling: Llama3RopeScaling | None = None
    # Keys a sliding layer's query at position p sees: positions > p - sliding_window (Mistral: every
    # layer; Gemma: the layers layer_types calls sliding).
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    qk_norm: bool = False  # RMSNorm over each q and k head before the rotation (Qwen3, Gemma 3)
    # Per layer SLIDING or FULL; empty: every layer slides where sliding_window is set (Mistral).
    layer_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # of the gated MLP: "silu" (SwiGLU) or "gelu_pytorch_tanh" (Gemma's GeGLU)
    rope_local_theta: float | None = None  # sliding layers' own rotary base, unscaled (Gemma 3's 10,000)
    rope_linear_factor: float = 1.0  # rope_type "linear": positions divided by it (Gemma 3 4B and up)
    query_pre_attn_scalar: float | None = None  # attention scale query_pre_attn_scalar**-0.5 (Gemma)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma 2, 3)
    attn_logit_softcapping: float | None = None  # attention scores s = cap * tanh(s / cap) (Gemma 2)
    # Mixture of experts (Qwen3-MoE, Mixtral; models/moe.py): num_experts > 0 makes the MLP of the
    # sparse layers num_experts gated MLPs of moe_intermediate_size, num_experts_per_tok of them per
    # token, weighted by the router's softmax (renormalised over those chosen where norm_topk_prob).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False
    # Which layers are sparse (as transformers' Qwen3-MoE says): every decoder_sparse_step-th one,
    # but not those of mlp_only_layers, which keep a dense MLP of intermediate_size.
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        if self.rms_norm_eps <= 0 or self.rope_theta <= 0:
            raise ValueError("rms_norm_eps and rope_theta must be positive")
        if self.sliding_window is not None and self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be positive or None, got {self.sliding_window}")
        if self.layer_types and (len(self.layer_types) != self.num_layers or set(self.layer_types) - {SLIDING, FULL}):
            raise ValueError(f"layer_types must name {SLIDING!r} or {FULL!r} for each of the {self.num_layers} "
                             f"layers, got {self.layer_types}")
        if self.hidden_act not in ("silu", "gelu_pytorch_tanh"):
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: silu, gelu_pytorch_tanh")
        if self.rope_linear_factor < 1.0 or (self.rope_linear_factor != 1.0 and self.rope_scaling is not None):
            raise ValueError("rope_linear_factor must be >= 1, and cannot be combined with llama3 rope scaling")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping", "attn_logit_softcapping"):
            if getattr(self, name) is not None and getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive or None, got {getattr(self, name)}")
        if self.num_experts and not (0 < self.num_experts_per_tok <= self.num_experts
                                     and self.moe_intermediate_size > 0 and self.decoder_sparse_step > 0):
            raise ValueError(f"a mixture of experts needs 0 < num_experts_per_tok <= num_experts and positive "
                             f"moe_intermediate_size and decoder_sparse_step, got {self.num_experts_per_tok}, "
                             f"{self.num_experts}, {self.moe_intermediate_size}, {self.decoder_sparse_step}")

    def sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts (else a dense MLP)."""
        return (self.num_experts > 0 and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    def window(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window, or None where it attends to the whole context."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] == FULL):
            return None
        return self.sliding_window

    @property
    def attention_scale(self) -> float:
        """The softmax scale of the attention scores."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_model_len(self) -> int:
        """Longest context this implementation computes exactly."""
        return self.max_position_embeddings

    @classmethod
    def from_hf_config(
        cls, hf: Mapping[str, Any], traits: Traits, *, source: str = "config.json"
    ) -> "ModelConfig":
        """From a Hugging Face config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`,
        either flat or, as Gemma 3's, one per layer type) and the `traits` of its architecture."""
        architecture = hf.get("model_type", "<no model_type>")
        fixed = traits(architecture, source)
        if "text_config" in hf:
            raise ValueError(f"{source}: a multimodal {architecture} config; only the text model's (e.g. "
                             "Gemma3ForCausalLM's model_type gemma3_text) is supported")
        for flag in ("attention_bias", "mlp_bias"):
            if hf.get(flag):
                raise ValueError(f"{source}: {flag}=true is not supported")
        layer_types = hf.get("layer_types")
        # Gemma 2 and 3 configs of transformers 4.x: a period, or none (Gemma 2's fixed one).
        pattern = hf.get("sliding_window_pattern") or _SLIDING_PATTERN.get(architecture.removesuffix("_text"))
        if layer_types is None and pattern:
            layer_types = [SLIDING if (i + 1) % pattern else FULL for i in range(hf["num_hidden_layers"])]
        if hf.get("use_sliding_window") and layer_types is None:
            raise ValueError(f"{source}: use_sliding_window=true without layer_types is not supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        local = {}
        if FULL in rope:  # one set of parameters per layer type
            rope, local = dict(rope[FULL]), dict(rope.get(SLIDING) or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3", "linear"):
            raise ValueError(f"{source}: unsupported rope_type {rope_type!r}; supported: default, llama3, linear")
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"{source}: unsupported sliding layers' rope_type {local['rope_type']!r}; only default")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        experts = hf.get("num_experts") or hf.get("num_local_experts") or 0
        return cls(**_with_traits(fixed, dict(
            architecture=architecture,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rms_norm_eps=hf["rms_norm_eps"],
            rope_theta=rope.get("rope_theta", hf.get("rope_theta", 10000.0)),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            rope_scaling=Llama3RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
            if rope_type == "llama3"
            else None,
            rope_linear_factor=rope["factor"] if rope_type == "linear" else 1.0,
            # Qwen2 configs of transformers 4.x carry a window with use_sliding_window=false: unused.
            sliding_window=None if hf.get("use_sliding_window") is False else hf.get("sliding_window"),
            layer_types=tuple(layer_types or ()),
            # Gemma names it hidden_activation (and keeps a stale hidden_act beside it in Gemma 2).
            hidden_act=hf.get("hidden_activation") or hf.get("hidden_act") or "silu",
            rope_local_theta=local.get("rope_theta", hf.get("rope_local_base_freq")),
            query_pre_attn_scalar=hf.get("query_pre_attn_scalar"),
            final_logit_softcapping=hf.get("final_logit_softcapping"),
            attn_logit_softcapping=hf.get("attn_logit_softcapping"),
            # Qwen3-MoE names them num_experts; Mixtral num_local_experts, its experts as wide as a dense MLP.
            num_experts=experts,
            num_experts_per_tok=hf.get("num_experts_per_tok") if experts else None,
            moe_intermediate_size=(hf.get("moe_intermediate_size") or hf["intermediate_size"]) if experts else None,
            norm_topk_prob=hf.get("norm_topk_prob"),
            decoder_sparse_step=hf.get("decoder_sparse_step") or 1,
            mlp_only_layers=tuple(hf.get("mlp_only_layers") or ()),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )))

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str], traits: Traits, *, source: str
    ) -> "ModelConfig":
        """From GGUF key/value metadata (llama.cpp names), the names of the tensors in the file and the
        `traits` of its architecture."""

        def get(key: str, default: Any = None) -> Any:
            if key in metadata:
                return metadata[key]
            if default is None:
                raise ValueError(f"{source}: GGUF metadata lacks {key!r}")
            return default

        arch = get("general.architecture")
        experts = metadata.get(f"{arch}.expert_count") or 0
        # llama.cpp writes Mixtral as "llama" with experts.
        architecture = "mixtral" if arch == "llama" and experts else arch
        fixed = traits(architecture, source)
        scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling not in ("none", "linear"):
            raise ValueError(f"{source}: unsupported rope scaling {scaling!r} in GGUF metadata")
        hidden, num_heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
        head_dim = get(f"{arch}.attention.key_length", hidden // num_heads)
        if get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
            raise ValueError(f"{source}: partial rotary embeddings (rope.dimension_count != head_dim) are unsupported")
        num_layers = get(f"{arch}.block_count")
        pattern = metadata.get(f"{arch}.attention.sliding_window_pattern", _SLIDING_PATTERN.get(arch))
        if isinstance(pattern, list):
            layer_types = tuple(SLIDING if sliding else FULL for sliding in pattern)
        else:
            layer_types = () if pattern is None else tuple(SLIDING if (i + 1) % pattern else FULL
                                                           for i in range(num_layers))
        eos = [] if metadata.get("tokenizer.ggml.eos_token_id") is None else [metadata["tokenizer.ggml.eos_token_id"]]
        if arch in _GEMMA_27B_LAYERS and "<end_of_turn>" in (tokens := metadata.get("tokenizer.ggml.tokens") or []):
            eos.append(tokens.index("<end_of_turn>"))  # a chat turn's end, an end of generation to llama.cpp too
        return cls(**_with_traits(fixed, dict(
            architecture=architecture,
            vocab_size=metadata.get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=get(f"{arch}.feed_forward_length"),
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=get(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=get(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=get(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            eos_token_ids=tuple(dict.fromkeys(eos)),
            rope_linear_factor=get(f"{arch}.rope.scaling.factor") if scaling == "linear" else 1.0,
            sliding_window=metadata.get(f"{arch}.attention.sliding_window"),
            rope_local_theta=metadata.get(f"{arch}.rope.freq_base_swa"),
            layer_types=layer_types,
            query_pre_attn_scalar=(hidden // num_heads if num_layers == _GEMMA_27B_LAYERS[arch] else head_dim)
            if arch in _GEMMA_27B_LAYERS else None,
            final_logit_softcapping=metadata.get(f"{arch}.final_logit_softcapping"),
            attn_logit_softcapping=metadata.get(f"{arch}.attn_logit_softcapping"),
            num_experts=experts,
            # The layers without a router keep a dense MLP (llama.cpp's files have every layer sparse).
            mlp_only_layers=tuple(i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in tensor_names)
            if experts else None,
            num_experts_per_tok=metadata.get(f"{arch}.expert_used_count") if experts else None,
            moe_intermediate_size=metadata.get(f"{arch}.expert_feed_forward_length",
                                               metadata.get(f"{arch}.feed_forward_length")) if experts else None,
            norm_topk_prob=metadata.get(f"{arch}.expert_weights_norm"),
        )))
