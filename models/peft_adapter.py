"""LoRA adapters saved by PEFT (`save_pretrained`: adapter_config.json and adapter_model.safetensors),
read with safetensors and checked against the base model's config.

What is supported is plain LoRA on the decoder layers' projections q/k/v/o/gate/up/down, with one rank
and one alpha for every module, scaled alpha / r or, under rsLoRA, alpha / sqrt(r). Whatever would make
the model compute something else (DoRA, adapters on the embedding or lm_head, trained biases, modules
saved whole, per-module ranks, base weights changed by the initialization, ...) is refused by a
ValueError naming the field or tensor; nothing is silently dropped.
"""

import contextlib
import dataclasses
import json
import math
import re
from pathlib import Path

import numpy as np
from safetensors import safe_open

from models.config import ModelConfig
from models.lora import TARGETS, module_shape

# Fields of adapter_config.json that change nothing at inference, whatever they hold.
_ANY = {
    "task_type", "peft_type", "auto_mapping", "peft_version", "base_model_name_or_path", "revision", "inference_mode",
    "r", "target_modules", "exclude_modules", "lora_alpha", "lora_dropout", "use_rslora", "init_lora_weights",
    "layers_to_transform", "layers_pattern", "megatron_core", "runtime_config", "ensure_weight_tying",
    "qalora_group_size",
}
# Initializations that change the base model's weights too (a residual base), unless converted on saving.
_BASE_CHANGING_INITS = ("pissa", "olora", "corda", "loftq", "eva", "lora_ga")
_TENSOR = re.compile(r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")


@dataclasses.dataclass(frozen=True)
class PeftAdapter:
    """A PEFT LoRA adapter read from `path`.

    modules: (layer, module name among models.lora.TARGETS) -> (A float32 [rank, in], B float32 [out, rank]).
    """

    path: Path
    rank: int
    alpha: float
    use_rslora: bool
    modules: dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)


def _refuse_config(config: dict, source: Path) -> None:
    if (peft_type := config.get("peft_type", "LORA")) != "LORA":
        raise ValueError(f"{source}: peft_type {peft_type!r} is not supported; only LORA adapters are")
    if config.get("use_dora"):
        raise ValueError(f"{source}: DoRA (use_dora) is not supported")
    if (bias := config.get("bias", "none")) != "none":
        raise ValueError(f"{source}: bias {bias!r} is not supported (trained biases); only 'none' is")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"{source}: init_lora_weights {init!r} is not supported: it changes the base model's weights")
    for key, value in config.items():
        if key not in _ANY and key not in ("use_dora", "bias") and value not in (None, False, [], {}, ""):
            raise ValueError(f"{source}: {key} = {value!r} is not supported")


def read(path: str | Path, base: ModelConfig) -> PeftAdapter:
    """The adapter in folder `path`, for a base model of config `base`.

    Raises FileNotFoundError for a missing file, ValueError for anything unsupported or not matching base
    (a tensor's shape, a layer past the model's, a module with only one of A and B).
    """
    path = Path(path)
    config_file, weights_file = path / "adapter_config.json", path / "adapter_model.safetensors"
    for file in (config_file, weights_file):
        if not file.exists():
            raise FileNotFoundError(f"{file}: missing; a PEFT adapter folder needs adapter_config.json and "
                                    "adapter_model.safetensors")
    config = json.loads(config_file.read_text())
    _refuse_config(config, config_file)
    rank, alpha = config.get("r"), config.get("lora_alpha")
    if not isinstance(rank, int) or rank < 1 or not isinstance(alpha, (int, float)):
        raise ValueError(f"{config_file}: r ({rank!r}) must be a positive integer and lora_alpha ({alpha!r}) a number")
    halves: dict[tuple[int, str], dict[str, np.ndarray]] = {}
    # numpy's reader, ten times faster here than going through JAX arrays (SmolLM2 at rank 16: 25 against
    # 200 ms), takes every dtype but bfloat16, which JAX's reads (opened only then: a few ms).
    with contextlib.ExitStack() as files:
        f, bf16 = files.enter_context(safe_open(weights_file, framework="numpy")), None
        for name in f.keys():
            match = _TENSOR.fullmatch(name)
            if match is None or match[2] not in TARGETS:
                raise ValueError(f"{weights_file}: tensor {name} is not supported; adapters are read on the "
                                 f"decoder layers' {', '.join(TARGETS)} (lora_A and lora_B) only")
            layer, module, half = int(match[1]), match[2], match[3]
            if layer >= base.num_layers:
                raise ValueError(f"{weights_file}: tensor {name} is for layer {layer}; the model has {base.num_layers}")
            fan_in, fan_out = module_shape(base, module)
            want = (rank, fan_in) if half == "A" else (fan_out, rank)
            reader = f
            if f.get_slice(name).get_dtype() == "BF16":
                bf16 = reader = bf16 or files.enter_context(safe_open(weights_file, framework="flax"))
            array = np.asarray(reader.get_tensor(name), np.float32)
            if array.shape != want:
                raise ValueError(f"{weights_file}: tensor {name} has shape {array.shape}; rank {rank} and the "
                                 f"base model imply {want}")
            halves.setdefault((layer, module), {})[half] = array
    modules = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise ValueError(f"{weights_file}: layer {layer}'s {module} has lora_{next(iter(pair))} without its pair")
        modules[layer, module] = pair["A"], pair["B"]
    if not modules:
        raise ValueError(f"{weights_file}: no LoRA tensors")
    return PeftAdapter(path, rank, float(alpha), bool(config.get("use_rslora")), modules)
