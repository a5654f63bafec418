"""A converted model on disk: a GGUF file's config, parameters and tokenizer, saved once in the cache
directory so later runs neither open nor dequantize the file.

Opening a GGUF walks every vocabulary entry in Python and dequantizing runs numpy over every tensor:
seconds, even for a small model. The saved form is a folder

    config.json       the ModelConfig's fields
    params/NAME.npy   each parameter of the model's state (NAME its dotted path), in its final layout and dtype
    tokenizer files   as save_pretrained writes them

Parameters are memory-mapped copy-on-write and, on the CPU, handed to JAX through DLPack, which wraps
the mapping without a copy: loading costs next to nothing, and pages are read from the page cache as
the model first touches them. Nothing writes to parameters, so no page is ever copied. (A read-only
mapping cannot go through DLPack, and DLPack has no bfloat16: those parameters are copied.)
"""

import dataclasses
import json
import os
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from models.config import Llama3RopeScaling, ModelConfig

FORMAT = 1  # part of the folder's name: bump it when what is saved, or how it is computed, changes
Params = dict[tuple, np.ndarray | jax.Array]  # state path (as nnx.to_flat_state gives it) -> value


def _file_name(path: tuple) -> str:
    return ".".join(map(str, path)) + ".npy"


def _state_path(file: Path) -> tuple:
    return tuple(int(k) if k.isdigit() else k for k in file.name.removesuffix(".npy").split("."))


def save(folder: Path, config: ModelConfig, params: Params, tokenizer) -> None:
    """Write the folder whole or not at all: it appears by one rename, so a reader never finds half
    of it. A failure (a read-only home, a full disk) only costs the next run the conversion again."""
    partial = folder.with_name(f"{folder.name}.{os.getpid()}.partial")
    try:
        (partial / "params").mkdir(parents=True, exist_ok=True)
        for path, value in params.items():
            np.save(partial / "params" / _file_name(path), np.asarray(value))
        (partial / "config.json").write_text(json.dumps(dataclasses.asdict(config)))
        if tokenizer is not None:
            tokenizer.save_pretrained(partial)
        partial.rename(folder)
    except OSError:
        pass  # including a folder that a concurrent run saved first
    finally:
        shutil.rmtree(partial, ignore_errors=True)


def _on_device(array: np.ndarray) -> jax.Array:
    if jax.default_backend() == "cpu" and array.dtype != jnp.bfloat16:
        return jax.dlpack.from_dlpack(array)
    return jnp.asarray(array)


def load(folder: Path, dtype, *, on_device: bool = True) -> tuple[ModelConfig, Params, object] | None:
    """(config, params, tokenizer or None) saved in `folder`, or None if nothing is saved there.
    on_device=False leaves the parameters as the host's memory-mapped arrays (for a caller that
    places them itself, shard by shard)."""
    if not (folder / "config.json").exists():
        return None
    fields = json.loads((folder / "config.json").read_text())
    rope_scaling = fields.pop("rope_scaling")
    config = ModelConfig(**fields | dict(
        rope_scaling=None if rope_scaling is None else Llama3RopeScaling(**rope_scaling),
        eos_token_ids=tuple(fields["eos_token_ids"]), layer_types=tuple(fields.get("layer_types", ())),
        mlp_only_layers=tuple(fields.get("mlp_only_layers", ()))))
    # np.save keeps bfloat16 as raw 2-byte values: the view gives them back their type.
    place = _on_device if on_device else lambda array: array
    params = {_state_path(file): place(np.load(file, mmap_mode="c").view(dtype))
              for file in (folder / "params").glob("*.npy")}
    tokenizer = None
    if (folder / "tokenizer.json").exists():
        from transformers import PreTrainedTokenizerFast  # a second to import; only needed from here on

        # fix_mistral_regex=False: transformers takes a local folder of a large vocabulary whose config.json
        # names no model_type (ours is a ModelConfig) for an old Mistral one, and warns of a wrong regex.
        tokenizer = PreTrainedTokenizerFast.from_pretrained(folder, fix_mistral_regex=False)
    return config, params, tokenizer
