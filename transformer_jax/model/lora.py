"""Low-rank adapters (LoRA, Hu et al. 2021): W x + s (x A) B beside a frozen W, s = opt.lora_alpha / opt.lora_rank.

A [in, r] starts as a random Gaussian (Hu et al.) and B [r, out] at zero, so a model with new adapters computes
exactly what its base does. The adapters are `nnx.LoRAParam`s: the train step differentiates and the optimizer
updates those alone (training/step.py `trainable`), so no gradient of a base weight is ever computed. Targets
(opt.lora_targets): the attention projections q, k, v, o of every attention module, ffn (every linear layer of every
feed-forward network) and embed (the embedding tables: rows [V, r] and [r, D]; the tied output projection reads the
same table, so its logits change with it). `merge` folds trained adapters into plain weights, W + s A B, for
evaluation and export.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from transformer_jax.errors import ConfigError
from transformer_jax.model.layers import Dense, Embedding, FeedForward, MultiHeadAttention

Array = jax.Array

_PROJECTIONS = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "o_proj"}
BASE = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))  # the frozen base's parameters, a filter
# A's initializers: variance 1/in for a linear layer (lecun normal; flax's nnx.LoRA draws he_uniform); an embedding
# reads one row of A per token, not a mix of `in` inputs, so its rows are unit normal (as loralib's random embedding
# factor).
LINEAR_A_INIT = nnx.initializers.lecun_normal()
EMBED_A_INIT = nnx.initializers.normal(1.0)


@dataclasses.dataclass(frozen=True)
class LoRASpec:
    """The adapters of a run: opt.lora_rank r, opt.lora_alpha, opt.lora_targets."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        """s = alpha / r, multiplying every adapter's update (flax's nnx.LoRA has none)."""
        return self.alpha / self.rank

    @classmethod
    def of(cls, config: Any) -> LoRASpec | None:
        """The adapters a full config asks for, or None (opt.lora_rank = 0)."""
        opt = config.opt
        if not opt.get("lora_rank", 0):
            return None
        return cls(int(opt.lora_rank), float(opt.lora_alpha), tuple(opt.lora_targets))


class Adapter(nnx.Module):
    """s (x A) B of a linear layer of width in -> out, computed in the layer's dtype."""

    def __init__(self, d_in: int, d_out: int, spec: LoRASpec, dtype: jnp.dtype, init: Any, *, rngs: nnx.Rngs):
        """init: A's initializer; B starts at zero."""
        self.a = nnx.LoRAParam(init(rngs.params(), (d_in, spec.rank), jnp.float32))
        self.b = nnx.LoRAParam(jnp.zeros((spec.rank, d_out), jnp.float32))
        self.scale = spec.scale
        self.dtype = dtype

    def __call__(self, x: Array) -> Array:
        a, b = self.a[...].astype(self.dtype), self.b[...].astype(self.dtype)
        return (x.astype(self.dtype) @ a @ b) * jnp.asarray(self.scale, self.dtype)

    def rows(self, tokens_BT: Array) -> Array:
        """An embedding adapter's rows s A[token] B [B, T, D], float32 as the table's rows."""
        return (self.a[...][tokens_BT] @ self.b[...]) * self.scale

    def attend(self, x_BTD: Array) -> Array:
        """An embedding adapter's share of the tied logits, s (x B^T) A^T [B, T, V], in float32."""
        a, b = self.a[...].astype(x_BTD.dtype), self.b[...].astype(x_BTD.dtype)
        x_BTR = jnp.einsum("btd,rd->btr", x_BTD, b)
        return jnp.einsum("btr,vr->btv", x_BTR, a, preferred_element_type=jnp.float32) * self.scale


def _width_check(spec: LoRASpec, target: str, where: str, d_in: int, d_out: int) -> None:
    if spec.rank > min(d_in, d_out):
        raise ConfigError(
            f"config key opt.lora_rank: {spec.rank} exceeds the width of the {target} target {where} "
            f"({d_in} -> {d_out}), which a rank-{min(d_in, d_out)} update already covers; lower opt.lora_rank or drop "
            f"{target} from opt.lora_targets"
        )


def add_adapters(model: nnx.Module, spec: LoRASpec, *, rngs: nnx.Rngs) -> None:
    """Attaches an adapter beside every targeted weight of `model` (a Transformer), in place; ConfigError naming
    opt.lora_rank when the rank exceeds a targeted layer's width."""
    for path, module in list(nnx.iter_modules(model)):
        where = "/".join(str(p) for p in path)
        layers: list[tuple[str, Dense]] = []
        if isinstance(module, MultiHeadAttention):
            layers = [(t, getattr(module, _PROJECTIONS[t])) for t in spec.targets if t in _PROJECTIONS]
        elif isinstance(module, FeedForward) and "ffn" in spec.targets:
            layers = [("ffn", layer) for layer in (module.w1, module.w3, module.w2) if layer is not None]
        elif isinstance(module, Embedding) and "embed" in spec.targets:
            rows, width = module.table_VD.shape
            _width_check(spec, "embed", where, rows, width)
            module.adapter = Adapter(rows, width, spec, jnp.float32, EMBED_A_INIT, rngs=rngs)
        for target, layer in layers:
            d_in, d_out = layer.kernel.shape
            _width_check(spec, target, where, d_in, d_out)
            layer.adapter = Adapter(d_in, d_out, spec, layer.dtype, LINEAR_A_INIT, rngs=rngs)


def merge(params: dict, adapters: dict, spec: LoRASpec) -> dict:
    """Plain parameters (a pure dict, as nnx.to_pure_dict of the base's nnx.Param state) with each adapter folded
    into its weight: W + s A B in float32 (a kernel [in, out], or an embedding table [V, D])."""
    flat, flat_adapters = dict(flatten_dict(params)), flatten_dict(adapters)
    for path, a in flat_adapters.items():
        if path[-1] != "a":
            continue
        module = path[:-2]  # .../<layer>/adapter/a
        b = flat_adapters[(*path[:-1], "b")]
        weight = (*module, "table_VD") if (*module, "table_VD") in flat else (*module, "kernel")
        flat[weight] = flat[weight] + jnp.matmul(a, b) * spec.scale
    return unflatten_dict(flat)
