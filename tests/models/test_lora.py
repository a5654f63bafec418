"""LoRA adapters made and saved by PEFT, run by our model from its slots: every row of a flat batch with
its own adapter (or none), against PEFT's own model of each adapter; and the adapters PEFT can save that
the model does not run, refused by name."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from conftest import hf_greedy, make_peft_adapter as make_adapter
from models import load_model, lora, peft_adapter
from test_models import GREEDY_STEPS, paged_greedy, random_prompts, ragged_logits

MAX_LORAS, MAX_RANK = 3, 16
# Different ranks, targets and scalings: rsLoRA on one, one on a single layer's projections only.
ADAPTERS = {
    "qv": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "all_rslora": dict(r=4, lora_alpha=8, use_rslora=True,
                       target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mlp_layer1": dict(r=16, lora_alpha=12, target_modules=["k_proj", "o_proj", "gate_proj", "down_proj"],
                       layers_to_transform=[1]),
}


@pytest.fixture(scope="module", params=("llama3", "qwen2"))
def base(request, tiny_checkpoint, tmp_path_factory):
    """(our model, config, transformers' base, {adapter: (folder, PEFT model)}) for one architecture."""
    folder, hf_model = tiny_checkpoint(request.param)
    model, config, _ = load_model(folder)
    adapters = {}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        adapter_folder = tmp_path_factory.mktemp(f"{request.param}-{name}")
        adapters[name] = adapter_folder, make_adapter(hf_model, adapter_folder, seed, **spec)
    return model, config, hf_model, adapters


def slots_with(config, adapters, order, packed: bool = False) -> lora.LoRAWeights:
    """Empty slots (in the C++ matmul's layout where packed) with adapters[order[s - 1]] read from its folder
    into slot s."""
    weights = lora.empty(config, MAX_LORAS, MAX_RANK, packed=packed)
    for slot, name in enumerate(order, start=1):
        read = peft_adapter.read(adapters[name][0], config)
        weights = lora.load_into(weights, np.int32(slot), lora.host_slot(config, MAX_RANK, read.modules, read.scale))
    return weights


def forward_with(graphdef, weights: lora.LoRAWeights, seq_slots: list[int], rows=None):
    """A forward as test_models' helpers call it, each sequence i of the batch on slot seq_slots[i]; rows:
    row slots (int32 [num_tokens]) -> LoRARows, over every slot unless given."""
    make_rows = rows or (lambda slots: lora.LoRARows.every_slot(slots, MAX_LORAS))
    seq_slots = jnp.asarray(seq_slots, jnp.int32)

    @functools.partial(jax.jit, donate_argnames=("kv_cache",))
    def forward(state, input_ids, positions, kv_cache, metadata, logits_indices):
        rows = jnp.arange(input_ids.shape[0])
        seq = jnp.searchsorted(metadata.query_start_loc, rows, side="right") - 1
        slots = jnp.where(rows < metadata.query_start_loc[-1], seq_slots[jnp.clip(seq, 0, len(seq_slots) - 1)], 0)
        return nnx.merge(graphdef, state)(input_ids, positions, kv_cache, metadata, logits_indices, lora=weights,
                                          lora_rows=make_rows(slots))

    return forward


# The base model and each adapter, in slots not in the table's order.
ORDER = ("mlp_layer1", "qv", "all_rslora")
MIXED = (None, "qv", "all_rslora", "mlp_layer1")


@pytest.mark.parametrize("packed", (False, True), ids=("xla_matmul", "packed"))
def test_mixed_batch_logits_match_peft(base, packed):
    """One step of 71 rows: where packed, from lora.PACKED_MAX_ROWS, by XLA's dot over the slots unpacked."""
    model, config, hf_model, adapters = base
    model = model.pack_for_cpu() if packed else model
    graphdef, state = nnx.split(model)
    seq_slots = [0 if name is None else ORDER.index(name) + 1 for name in MIXED]
    forward = forward_with(graphdef, slots_with(config, adapters, ORDER, packed), seq_slots)
    prompts = random_prompts(config, (7, 13, 30, 21))
    for name, prompt, got in zip(MIXED, prompts, ragged_logits(forward, state, config, prompts), strict=True):
        reference = hf_model if name is None else adapters[name][1]
        with torch.no_grad():
            want = reference(torch.tensor([prompt])).logits[0].numpy()
        base_logits = hf_model(torch.tensor([prompt])).logits[0].detach().numpy()
        assert name is None or np.abs(want - base_logits).max() > 0.05 * np.abs(want).max()  # the adapter matters
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name


@pytest.mark.parametrize("packed", (False, True), ids=("xla_matmul", "packed"))
def test_mixed_batch_greedy_matches_peft(base, packed):
    """Prompts in chunks of 5 beside other sequences' decode tokens, every sequence on its own slot (steps of
    few rows: where packed, the C++ kernel's)."""
    model, config, hf_model, adapters = base
    model = model.pack_for_cpu() if packed else model
    graphdef, state = nnx.split(model)
    seq_slots = [0 if name is None else ORDER.index(name) + 1 for name in MIXED]
    forward = forward_with(graphdef, slots_with(config, adapters, ORDER, packed), seq_slots)
    prompts = random_prompts(config, (9, 23, 14, 17))
    got = paged_greedy(forward, state, config, prompts, block_size=4, chunk_size=5)
    want = [hf_greedy(hf_model if name is None else adapters[name][1], p, GREEDY_STEPS)
            for name, p in zip(MIXED, prompts)]
    assert got == want
    assert want[1] != hf_greedy(hf_model, prompts[1], GREEDY_STEPS)  # the adapter changes the tokens


@pytest.mark.parametrize("packed", (False, True), ids=("xla_matmul", "packed"))
def test_loading_compiles_once_and_zeros_free_a_slot(base, packed):
    """Every adapter into every slot is one program; loading zeros gives the base model back."""
    model, config, hf_model, adapters = base
    weights = slots_with(config, adapters, ORDER, packed)
    compiled = lora.load_into._cache_size()
    weights = slots_with(config, adapters, tuple(reversed(ORDER)), packed)
    zeros = lora.host_slot(config, MAX_RANK, {}, 1.0)
    for slot in range(1, MAX_LORAS + 1):
        weights = lora.load_into(weights, np.int32(slot), zeros)
    assert lora.load_into._cache_size() == compiled
    assert all(not np.asarray(x).any() for x in jax.tree.leaves(weights))


def _saved(tmp_path, hf_model, **config):
    folder = tmp_path / "adapter"
    make_adapter(hf_model, folder, 0, **config)
    return folder


@pytest.mark.parametrize("spec, named", [
    (dict(use_dora=True), "DoRA"),
    (dict(target_modules=["q_proj", "embed_tokens"]), "embed_tokens"),
    (dict(target_modules=["q_proj", "lm_head"]), "lm_head"),
    (dict(bias="lora_only"), "bias"),
    (dict(modules_to_save=["lm_head"]), "modules_to_save"),
    (dict(rank_pattern={"q_proj": 4}, target_modules=["q_proj", "v_proj"]), "rank_pattern"),
])
def test_unsupported_adapters_are_refused_by_name(tiny_checkpoint, tmp_path, spec, named):
    folder, hf_model = tiny_checkpoint("llama3")
    config = load_model(folder).config
    adapter = _saved(tmp_path, hf_model, **dict(r=4, lora_alpha=8, target_modules=["q_proj"]) | spec)
    with pytest.raises(ValueError, match=named):
        peft_adapter.read(adapter, config)


def test_adapter_for_another_base_is_refused(tiny_checkpoint, tmp_path):
    folder, hf_model = tiny_checkpoint("llama3")
    other = load_model(tiny_checkpoint("qwen3")[0]).config  # head_dim 32: q_proj's B is another shape
    adapter = _saved(tmp_path, hf_model, r=4, lora_alpha=8, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="q_proj.lora_B.weight has shape"):
        peft_adapter.read(adapter, other)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps(config | dict(peft_type="IA3")))
    with pytest.raises(ValueError, match="IA3"):
        peft_adapter.read(adapter, load_model(folder).config)


@pytest.mark.parametrize("packed, packed_slots", [(False, False), (True, True), (False, True)],
                         ids=("xla_matmul", "packed", "packed_slots_over_xla_matmul"))
def test_one_adapter_over_its_slot_alone_matches_peft(base, packed, packed_slots):
    """A step whose rows use one adapter (and the base model) gathers that slot alone (LoRARows of one slot).
    Packed slots over a model that is not: the C++ kernel (cpu_kernel.lora_cpu) adds the delta to XLA's base
    matmul, as to int8 weights' or oneDNN's."""
    model, config, hf_model, adapters = base
    model = model.pack_for_cpu() if packed else model
    graphdef, state = nnx.split(model)
    slot = ORDER.index("all_rslora") + 1
    one = lambda slots: lora.LoRARows(jnp.asarray([slot], jnp.int32), jnp.where(slots == slot, 0, -1))
    forward = forward_with(graphdef, slots_with(config, adapters, ORDER, packed_slots), [slot, 0, slot], rows=one)
    prompts = random_prompts(config, (7, 13, 30))
    for name, prompt, got in zip(("all_rslora", None, "all_rslora"), prompts,
                                 ragged_logits(forward, state, config, prompts), strict=True):
        with torch.no_grad():
            want = (hf_model if name is None else adapters[name][1])(torch.tensor([prompt])).logits[0].numpy()
        assert np.abs(got - want).max() <= 1e-4 * np.abs(want).max(), name


def test_bfloat16_adapter_is_read_exactly(tiny_checkpoint, tmp_path):
    """An adapter saved in bfloat16 (as PEFT saves one trained in bfloat16): its values, widened."""
    from safetensors.torch import load_file, save_file

    folder, hf_model = tiny_checkpoint("llama3")
    make_adapter(hf_model, tmp_path, 0, r=4, lora_alpha=8, target_modules=["q_proj"])
    file = tmp_path / "adapter_model.safetensors"
    tensors = {name: t.to(torch.bfloat16) for name, t in load_file(file).items()}
    save_file(tensors, file)
    read = peft_adapter.read(tmp_path, load_model(folder).config)
    a, b = read.modules[1, "q_proj"]
    name = "base_model.model.model.layers.1.self_attn.q_proj.lora_{}.weight"
    assert np.array_equal(a, tensors[name.format("A")].float().numpy())
    assert np.array_equal(b, tensors[name.format("B")].float().numpy())
