"""What a Llama-family checkpoint says about its shape, read from config.json or GGUF metadata."""

import dataclasses
from collections.abc import Collection, Mapping
from typing import Any



def _refuse_architecture(name: str, source: str) -> None:
    # Imported here: the registry imports the model classes, which import this module.
    from models.registry import architecture

    architecture(name, source)


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
    """A decoder of the Llama family: GQA attention with rotary embeddings, RMSNorm, SwiGLU MLP."""

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
    # Mistral's window. The attention is full, which is exact while contexts stay within the window:
    # the engine keeps them under max_model_len.
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        _refuse_architecture(self.architecture, "ModelConfig")
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

    @property
    def group_size(self) -> int:
        """Query heads per KV head."""
        return self.num_heads // self.num_kv_heads

    @property
    def max_model_len(self) -> int:
        """Longest context this implementation computes exactly."""
        return min(self.max_position_embeddings, self.sliding_window or self.max_position_embeddings)

    @classmethod
    def from_hf_config(cls, hf: Mapping[str, Any], *, source: str = "config.json") -> "ModelConfig":
        """From a Hugging Face config.json dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        architecture = hf.get("model_type", "<no model_type>")
        _refuse_architecture(architecture, source)
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: unsupported hidden_act {hf['hidden_act']!r}; only silu (SwiGLU)")
        for flag in ("attention_bias", "mlp_bias", "use_sliding_window"):
            if hf.get(flag):
                raise ValueError(f"{source}: {flag}=true is not supported")
        rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", "llama3"):
            raise ValueError(f"{source}: unsupported rope_type {rope_type!r}; supported: default, llama3")
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        return cls(
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
            qkv_bias=architecture == "qwen2",
            rope_scaling=Llama3RopeScaling(
                factor=rope["factor"],
                low_freq_factor=rope["low_freq_factor"],
                high_freq_factor=rope["high_freq_factor"],
                original_max_position_embeddings=rope["original_max_position_embeddings"],
            )
            if rope_type == "llama3"
            else None,
            sliding_window=hf.get("sliding_window") if architecture == "mistral" else None,
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,)),
        )

    @classmethod
    def from_gguf_metadata(
        cls, metadata: Mapping[str, Any], tensor_names: Collection[str], *, source: str
    ) -> "ModelConfig":
        """From GGUF key/value metadata (llama.cpp names) and the names of the tensors in the file."""

        def get(key: str, default: Any = None) -> Any:
            if key in metadata:
                return metadata[key]
            if default is None:
                raise ValueError(f"{source}: GGUF metadata lacks {key!r}")
            return default

        arch = get("general.architecture")
        _refuse_architecture(arch, source)
        scaling = metadata.get(f"{arch}.rope.scaling.type", "none")
        if scaling != "none":
            raise ValueError(f"{source}: unsupported rope scaling {scaling!r} in GGUF metadata")
        hidden, num_heads = get(f"{arch}.embedding_length"), get(f"{arch}.attention.head_count")
        head_dim = get(f"{arch}.attention.key_length", hidden // num_heads)
        if get(f"{arch}.rope.dimension_count", head_dim) != head_dim:
            raise ValueError(f"{source}: partial rotary embeddings (rope.dimension_count != head_dim) are unsupported")
        eos = metadata.get("tokenizer.ggml.eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=metadata.get(f"{arch}.vocab_size") or len(get("tokenizer.ggml.tokens")),
            hidden_size=hidden,
            intermediate_size=get(f"{arch}.feed_forward_length"),
            num_layers=get(f"{arch}.block_count"),
            num_heads=num_heads,
            num_kv_heads=get(f"{arch}.attention.head_count_kv", num_heads),
            head_dim=head_dim,
            rms_norm_eps=get(f"{arch}.attention.layer_norm_rms_epsilon"),
            rope_theta=get(f"{arch}.rope.freq_base", 10000.0),
            max_position_embeddings=get(f"{arch}.context_length"),
            tie_word_embeddings="output.weight" not in tensor_names,
            qkv_bias=arch == "qwen2",
            eos_token_ids=() if eos is None else (eos,),
        )
