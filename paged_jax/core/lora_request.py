"""LoRARequest: which adapter a request runs with, as vLLM's (name, id, path)."""

import dataclasses


@dataclasses.dataclass(frozen=True)
class LoRARequest:
    """lora_name: what the user calls it; lora_int_id: its number, >= 1, the engine's key for it (two
    requests with the same id run the same adapter); lora_path: its PEFT folder (adapter_config.json and
    adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self):
        if not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")

    @property
    def prefix_root(self) -> int:
        """The parent of the first block's name in the prefix cache (prefix_cache.ROOT_HASH is the base
        model's): K/V computed under one adapter is never found under another, or under none."""
        return hash(("lora", self.lora_int_id))
