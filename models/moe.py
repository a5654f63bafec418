"""The sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral): a router picks each token's top k of E gated
MLPs (the experts), and the token's output is their outputs weighted by the router's probabilities.

Routing is transformers': router logits in the weights' dtype, softmax in float32 over all E experts, the
top k of those probabilities, renormalised to sum to 1 where config.norm_topk_prob (always in Mixtral),
then cast to the activations' dtype (as Qwen3-MoE's; transformers' Mixtral weighs its bfloat16 experts'
outputs by the float32 weights, a rounding apart; in float32 both are the same).

The experts run as one grouped matmul over the token copies sorted by expert: each (token, choice) pair is
a row, rows are sorted by their expert, and group_sizes (a bincount of the choices) says how many rows
each expert takes; every row meets its own expert's weights only, never all E. Two forms of it:
- `jax.lax.ragged_dot`, JAX's grouped matmul, where the weights are XLA's (unpacked, or split over a
  mesh). On TPU and GPU XLA is given a grouped matmul; on the CPU JAX lowers it to a dense dot of
  every row against every expert with the other experts' rows masked to zero (jax's
  `_ragged_dot_general_impl`), and XLA copies every expert's weights into the dot's layout on each
  call: exact, but E times the multiply-adds and every expert's weights read, whatever the routing.
- on the CPU after `pack`, each expert's weights packed for the C++ matmul (kernels_pallas/cpu/linear.cc),
  one call per expert on its own group's rows: the kernel multiplies only the leading `rows` rows it
  is given, so an expert no token chose costs no weight read, and one of n rows costs n rows' work.
  A decode step then reads the weights of only the experts its tokens chose
  (scripts/bench_moe.py measures both forms against a dense model of the same active parameters).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from models.config import ModelConfig
from models.layers import ACTIVATIONS, linear, normal, param
from models.sharding import TP_AXIS

# x [rows, hidden] (rows grouped by expert) against w [E, hidden, ...]: hidden contracted, E the group.
_ROWS_BY_EXPERT = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def route(logits: jax.Array, top_k: int, renormalize: bool, dtype) -> tuple[jax.Array, jax.Array]:
    """logits: [num_tokens, num_experts] (the router's, in the weights' dtype) -> (weights [num_tokens,
    top_k] in dtype, experts int32 [num_tokens, top_k]): the top_k experts by softmax probability,
    highest first, and their probabilities (renormalised over the top_k where renormalize)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, experts = jax.lax.top_k(probs, top_k)
    if renormalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights.astype(dtype), experts.astype(jnp.int32)


class SparseMoE(nnx.Module):
    """E experts, each a gated MLP (act(x @ gate) * (x @ up)) @ down of width moe_intermediate_size, and
    the router choosing num_experts_per_tok of them per token.

    Weights, stacked over experts: router [hidden, E]; expert_gate_up [E, hidden, 2, intermediate];
    expert_down [E, intermediate, hidden]. Under tensor parallelism every expert is split as the dense
    MLP is, over its intermediate axis (column-parallel gate/up, row-parallel down: one all-reduce per
    layer), and the router is replicated, so every device routes every token alike.
    """

    def __init__(self, config: ModelConfig, *, dtype, rngs: nnx.Rngs):
        c = config
        e, h, i = c.num_experts, c.hidden_size, c.moe_intermediate_size
        self.config = c
        self.router = param(rngs, normal, (h, e), (None, None), dtype)
        self.expert_gate_up = param(rngs, normal, (e, h, 2, i), (None, None, None, TP_AXIS), dtype)
        self.expert_down = param(rngs, normal, (e, i, h), (None, TP_AXIS, None), dtype)
        self.packed = False

    def __call__(self, x: jax.Array, rows=None, lora=None) -> jax.Array:
        """x: [num_tokens, hidden] -> [num_tokens, hidden]. rows: int32 scalar, the leading rows that are
        real tokens (padding rows are routed nowhere and give zeros), or None: all. lora: None; LoRA
        adapters (models/lora.py) have no deltas for experts, and are refused rather than dropped."""
        if lora is not None:
            raise NotImplementedError("LoRA adapters are not supported on a mixture of experts' layers")
        c = self.config
        num_tokens, k = x.shape[0], c.num_experts_per_tok
        weights, experts = route(jnp.dot(x, self.router[...]), k, c.norm_topk_prob, x.dtype)
        if rows is not None:  # to a group past the last expert, which no matmul reads
            experts = jnp.where(jnp.arange(num_tokens)[:, None] < rows, experts, c.num_experts)
        choices = experts.reshape(-1)  # row r is token r // k's choice r % k
        order = jnp.argsort(choices, stable=True)
        group_sizes = jnp.bincount(choices, length=c.num_experts).astype(jnp.int32)
        grouped = self._grouped_packed if self.packed else self._grouped_ragged
        y = grouped(x[order // k], group_sizes)  # [num_tokens * k, hidden], rows in expert order
        y = jnp.where((choices[order] < c.num_experts)[:, None], y, 0) * weights.reshape(-1)[order][:, None]
        # Back to token order, each token's k outputs summed.
        unsorted = jnp.zeros_like(y).at[order].set(y, unique_indices=True)
        return unsorted.reshape(num_tokens, k, -1).sum(axis=1)

    def _gated(self, gate: jax.Array, up: jax.Array) -> jax.Array:
        return ACTIVATIONS[self.config.hidden_act](gate) * up

    def _grouped_ragged(self, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """xs: [rows, hidden] sorted by expert, group_sizes: int32 [E] -> [rows, hidden] (zeros past the
        groups). Gate and up in one ragged_dot_general over the [E, hidden, 2, intermediate] weight as it
        is: no slice of it to copy, and no reshape of its intermediate axis, which a mesh splits."""
        gate_up = jax.lax.ragged_dot_general(xs, self.expert_gate_up[...], group_sizes, _ROWS_BY_EXPERT)
        return jax.lax.ragged_dot(self._gated(gate_up[:, 0], gate_up[:, 1]), self.expert_down[...], group_sizes)

    def _grouped_packed(self, xs: jax.Array, group_sizes: jax.Array) -> jax.Array:
        """As _grouped_ragged, through the C++ matmul: expert j multiplies the rows of its group, moved to
        the top of its input, and only those. Each expert's output is written at its group's start in
        ascending order: the zeros it gives past its group land where the later experts write next."""
        c = self.config
        num_rows, i = xs.shape[0], c.moe_intermediate_size
        starts = jnp.cumsum(group_sizes) - group_sizes
        xs = jnp.concatenate([xs, jnp.zeros_like(xs)])  # so every group's window of num_rows fits
        out = jnp.zeros_like(xs)
        for j in range(c.num_experts):
            rows = jax.lax.dynamic_slice_in_dim(xs, starts[j], num_rows)
            gate_up = linear(rows, self.expert_gate_up[j][...], (2, i), True, group_sizes[j])
            y = linear(self._gated(gate_up[:, 0], gate_up[:, 1]), self.expert_down[j][...], (c.hidden_size,), True,
                       group_sizes[j])
            out = jax.lax.dynamic_update_slice_in_dim(out, y, starts[j], 0)
        return out[:num_rows]

    def pack(self, packer) -> None:
        """Hold each expert's gate/up and down packed by `packer` (cpu_kernel.pack_columns, or pack_int8),
        for `_grouped_packed`: one array per expert, since a slice of one stacked array would be copied
        out of it on every call (as XLA feeds a custom call), costing a weight read and write per expert."""
        for name in ("expert_gate_up", "expert_down"):
            stacked = getattr(self, name)[...]
            setattr(self, name, nnx.List([nnx.Param(p := packer(w.reshape(w.shape[0], -1)), out_sharding=(None,) * p.ndim,
                                                    eager_sharding=False) for w in stacked]))
        self.packed = True
