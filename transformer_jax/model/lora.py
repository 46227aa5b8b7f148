"""Low-rank adapters (LoRA, Hu et al. 2021): W x + s (x A) B beside a frozen W, s = opt.lora_alpha / opt.lora_rank.

A [in, r] starts as a random Gaussian (Hu et al.) and B [r, out] at zero, so a model with new adapters computes
exactly what its base does. The adapters are `nnx.LoRAParam`s: the train step differentiates and the optimizer
updates those alone (training/step.py `trainable`), so no gradient of a base weight is ever computed. Targets
(opt.lora_targets): the attention projections q, k, v, o of every attention module, ffn (every linear layer of every
feed-forward network) and embed (the embedding tables: rows [V, r] and [r, D]; the tied output projection reads the
same table, so its logits change with it). `merge` folds trained adapters into plain weights, W + s A B, for
evaluation and export. The rows of languages a run adds (data.add_languages) train as NewRows, deltas beside the
frozen table (training/add_languages.py).
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
    new_rows: int = 0  # data.add_languages: the last rows of each embedding table, trained as NewRows

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
        added = len(config.data.get("add_languages", ())) if "data" in config else 0
        return cls(int(opt.lora_rank), float(opt.lora_alpha), tuple(opt.lora_targets), added)


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


class NewRows(nnx.Module):
    """The rows of added languages (data.add_languages) under LoRA, whose base table is frozen: a delta [n, D] on the
    table's last n rows, starting at zero (so the model starts as its grown base), trained as adapters are, and
    added into the table by `merge`. It stands in an Embedding's `adapter` place with that interface, wrapping the
    embedding's own adapter (opt.lora_targets embed), if any, as `inner`."""

    def __init__(self, vocab_size: int, d_model: int, new_rows: int, inner: Adapter | None):
        self.delta_ND = nnx.LoRAParam(jnp.zeros((new_rows, d_model), jnp.float32))
        self.first = vocab_size - new_rows
        self.inner = inner

    def rows(self, tokens_BT: Array) -> Array:
        """The delta of each token's row [B, T, D] (zero for the source's tokens), float32 as the table's rows."""
        new_BT = tokens_BT >= self.first
        delta_BTD = self.delta_ND[...][jnp.where(new_BT, tokens_BT - self.first, 0)]
        rows_BTD = jnp.where(new_BT[..., None], delta_BTD, 0.0)
        return rows_BTD if self.inner is None else self.inner.rows(tokens_BT) + rows_BTD

    def attend(self, x_BTD: Array) -> Array:
        """The deltas' share of the tied logits [B, T, V] (zero for the source's ids), in float32."""
        new_BTN = jnp.einsum(
            "btd,nd->btn", x_BTD, self.delta_ND[...].astype(x_BTD.dtype), preferred_element_type=jnp.float32
        )
        logits_BTV = jnp.pad(new_BTN, ((0, 0), (0, 0), (self.first, 0)))
        return logits_BTV if self.inner is None else self.inner.attend(x_BTD) + logits_BTV


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
        if isinstance(module, Embedding) and spec.new_rows:
            rows, width = module.table_VD.shape
            module.adapter = NewRows(rows, width, spec.new_rows, module.adapter)
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
        module = path[: path.index("adapter")]  # .../<layer>/adapter/a, or .../<embedding>/adapter/inner/a
        b = flat_adapters[(*path[:-1], "b")]
        weight = (*module, "table_VD") if (*module, "table_VD") in flat else (*module, "kernel")
        flat[weight] = flat[weight] + jnp.matmul(a, b) * spec.scale
    for path, delta_ND in flat_adapters.items():  # added languages' rows: the last n of their table
        if path[-1] == "delta_ND":
            table = (*path[: path.index("adapter")], "table_VD")
            flat[table] = flat[table].at[-delta_ND.shape[0] :].add(delta_ND)
    return unflatten_dict(flat)
