"""Hugging Face Marian (OPUS-MT) <-> our Transformer: the one table of parameter names, and the parameters and the
config both ways (marian_folder.py reads and writes the folders). Axis letters: see transformer_jax/__init__.py.

How transformers' MarianMTModel (models/marian/modeling_marian.py) maps onto model/transformer.py:
- torch's nn.Linear weight is [out, in], our kernel [in, out]: linear weights are transposed. Heads are
  consecutive column blocks on both sides and both scale q.k by head_dim ** -0.5: no head axis is reshaped.
- Both are post-LN without a final stack norm, scale embeddings by sqrt(d_model), add static sinusoidal positions
  in Marian's concatenated layout (sin of every frequency, then cos), compute logits y E^T + final_logits_bias and
  FFN fc2(act(fc1 x)). transformers fixes LayerNorm's epsilon at 1e-5 (nn.LayerNorm's default).
- A model in the paper's interleaved layout exports exactly by permuting the model axis D of every weight
  (`permutation`): positions then add in Marian's layout, and LayerNorm commutes with a permutation of features.
- Marian's special ids are kept: `</s>` = 0, `<unk>` = 1, `<pad>` = the last row; decoding starts from pad
  (decoder_start_token_id), our model.bos_id.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from transformer_jax.data.tokenizer import MARIAN_SPECIAL_PIECES
from transformer_jax.errors import ConfigError
from transformer_jax.model import TransformerSpec, build_model, model_rngs
from transformer_jax.model.layers import LayerNorm

MODEL_TYPE = "marian"
NORM_EPSILON = 1e-5  # transformers' Marian builds nn.LayerNorm(d_model): torch's default epsilon
UNK_PIECE, EOS_PIECE, PAD_PIECE = (MARIAN_SPECIAL_PIECES[field] for field in ("unk", "eos", "pad"))
_ALIGN_BYTES = 64  # the alignment at which jax's CPU client aliases a host buffer instead of copying it

# Marian activation_function -> model.activation. transformers' "swish" and "silu" are both SiLU; its "gelu" is
# the exact erf form while ours (jax.nn.gelu's default) is the tanh approximation, which it calls gelu_new.
ACTIVATIONS = {"swish": "swish", "silu": "swish", "relu": "relu", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
EXPORT_ACTIVATIONS = {"swish": "swish", "relu": "relu", "gelu": "gelu_new"}

LINEAR, VECTOR, ROW = "linear", "vector", "row"  # transposed [out, in]; copied as is; Marian's [1, V] bias row


@dataclasses.dataclass(frozen=True)
class Entry:
    """One parameter: its Marian state-dict name, our path in nnx.to_pure_dict(nnx.state(model, nnx.Param)), how
    it converts (`kind`) and which axis of our array is the model axis D (None: none is)."""

    marian: str
    ours: tuple[str | int, ...]
    kind: str
    model_axis: int | None


def _linear(marian: str, ours: tuple, d_in: bool) -> Iterator[Entry]:
    """A linear layer: kernel [in, out] and bias [out]; D is its input (d_in) or its output."""
    yield Entry(f"{marian}.weight", (*ours, "kernel"), LINEAR, 0 if d_in else 1)
    yield Entry(f"{marian}.bias", (*ours, "bias"), VECTOR, None if d_in else 0)


def _norm(marian: str, ours: tuple) -> Iterator[Entry]:
    """A LayerNorm: `ours` is the path of our norm module (a residual's (..., "norm") or a stack's "encoder_norm")."""
    yield Entry(f"{marian}.weight", (*ours, "scale_D"), VECTOR, 0)
    yield Entry(f"{marian}.bias", (*ours, "bias_D"), VECTOR, 0)


def _attention(marian: str, ours: tuple, name: str) -> Iterator[Entry]:
    """An attention block and the norm of its residual; `name`: ours, "self_attn" or "cross_attn"."""
    theirs = {"self_attn": "self_attn", "cross_attn": "encoder_attn"}[name]
    for proj in ("q_proj", "k_proj", "v_proj"):
        yield from _linear(f"{marian}.{theirs}.{proj}", (*ours, name, proj), d_in=True)
    yield from _linear(f"{marian}.{theirs}.out_proj", (*ours, name, "o_proj"), d_in=False)
    yield from _norm(f"{marian}.{theirs}_layer_norm", (*ours, f"{name}_residual", "norm"))


def _ffn(marian: str, ours: tuple) -> Iterator[Entry]:
    yield from _linear(f"{marian}.fc1", (*ours, "ffn", "w1"), d_in=True)
    yield from _linear(f"{marian}.fc2", (*ours, "ffn", "w2"), d_in=False)
    yield from _norm(f"{marian}.final_layer_norm", (*ours, "ffn_residual", "norm"))


def table(spec: Any) -> list[Entry]:
    """Every parameter of a model of `spec` (model.layers.TransformerSpec) with its Marian name: the one mapping.

    Embeddings: shared ones are Marian's model.shared.weight; separate ones its encoder and decoder embed_tokens.
    A tied output layer has no entry of its own (`aliases` names Marian's tied copies); an untied one is lm_head.
    """
    entries = []
    if spec.share_embeddings:
        entries.append(Entry("model.shared.weight", ("src_embed", "table_VD"), VECTOR, 1))
    else:
        entries.append(Entry("model.encoder.embed_tokens.weight", ("src_embed", "table_VD"), VECTOR, 1))
        entries.append(Entry("model.decoder.embed_tokens.weight", ("tgt_embed", "table_VD"), VECTOR, 1))
    if not spec.tie_output:
        entries.append(Entry("lm_head.weight", ("output_proj", "kernel"), LINEAR, 0))
    if spec.final_logits_bias:  # Marian's; M2M-100 has none
        entries.append(Entry("final_logits_bias", ("final_logits_bias_V",), ROW, None))
    if spec.norm_position == "pre":  # each stack's final norm (M2M-100's; Marian is post-LN)
        entries += _norm("model.encoder.layer_norm", ("encoder_norm",))
        entries += _norm("model.decoder.layer_norm", ("decoder_norm",))
    for i in range(spec.num_encoder_layers):
        marian, ours = f"model.encoder.layers.{i}", ("encoder_layers", i)
        entries += [*_attention(marian, ours, "self_attn"), *_ffn(marian, ours)]
    for i in range(spec.num_decoder_layers):
        marian, ours = f"model.decoder.layers.{i}", ("decoder_layers", i)
        entries += [*_attention(marian, ours, "self_attn"), *_attention(marian, ours, "cross_attn")]
        entries += _ffn(marian, ours)
    return entries


def aliases(spec: Any) -> dict[str, str]:
    """Marian names that hold a tied copy of another entry's array -> that entry's Marian name.

    Older checkpoints store every tied copy; transformers writes one. A copy that is present must equal its
    original (else the weights are not tied as the config says).
    """
    target_embed = "model.shared.weight" if spec.share_embeddings else "model.decoder.embed_tokens.weight"
    embeds = ("model.encoder.embed_tokens.weight", "model.decoder.embed_tokens.weight")
    tied = dict.fromkeys(embeds if spec.share_embeddings else (), target_embed)
    if spec.tie_output:
        tied["lm_head.weight"] = target_embed
    return tied


POSITION_KEYS = ("model.encoder.embed_positions.weight", "model.decoder.embed_positions.weight")


def marian_positions(num_positions: int, d_model: int) -> np.ndarray:
    """[P, D] float32: MarianSinusoidalPositionalEmbedding.create_weight, computed as transformers computes it."""
    j = np.arange(d_model)
    position_enc = np.arange(num_positions)[:, None] / np.power(10000, 2 * (j // 2) / d_model)[None, :]
    half = d_model // 2 + d_model % 2
    out = np.empty((num_positions, d_model), np.float32)
    out[:, :half] = np.sin(position_enc[:, 0::2])
    out[:, half:] = np.cos(position_enc[:, 1::2])
    return out


def permutation(d_model: int) -> np.ndarray:
    """[D] int: column j of the concatenated layout is column permutation[j] of the interleaved one (sin of
    frequency i: 2i -> i; cos: 2i + 1 -> D/2 + i)."""
    return np.concatenate([np.arange(0, d_model, 2), np.arange(1, d_model, 2)])


def to_marian(entry: Entry, ours: np.ndarray, perm: np.ndarray | None = None) -> np.ndarray:
    """Our array of `entry` as Marian stores it; `perm`: the model-axis permutation of an interleaved model."""
    if perm is not None and entry.model_axis is not None:
        ours = np.take(ours, perm, axis=entry.model_axis)
    if entry.kind == LINEAR:
        return np.ascontiguousarray(ours.T)
    if entry.kind == ROW:
        return ours.reshape(1, -1)
    return ours


def from_marian(entry: Entry, marian: np.ndarray, expected: tuple[int, ...], copy: bool = True) -> np.ndarray:
    """Marian's array of `entry` as our float32 array of shape `expected` (copy=False: possibly a view of it);
    ConfigError naming the tensor if the shapes disagree."""
    array = marian.T if entry.kind == LINEAR else marian.reshape(-1) if entry.kind == ROW else marian
    if tuple(array.shape) != tuple(expected):
        shape = tuple(expected[::-1]) if entry.kind == LINEAR else (1, *expected) if entry.kind == ROW else expected
        raise ConfigError(
            f"tensor {entry.marian} has shape {tuple(marian.shape)} but config.json says {shape}; the weights and "
            "config.json are of different models"
        )
    return np.ascontiguousarray(array, dtype=np.float32) if copy else array


# -- the parameters both ways --------------------------------------------------------------------------------------


def _aligned_buffers(shapes: dict[tuple, Any]) -> dict[tuple, np.ndarray]:
    """A float32 array of each shape, all views of one buffer allocated up front, each starting on a 64-byte
    boundary: jax takes such a buffer over without a copy (jax.dlpack.from_dlpack); a view at any other address it
    copies. Arrays allocated one by one between a reader's temporaries would leave the freed temporaries as holes
    the allocator keeps (benchmarks/convert_marian.py measured half the weights again)."""
    align = _ALIGN_BYTES // 4
    sizes = {path: -(-int(np.prod(x.shape)) // align) * align for path, x in shapes.items()}
    raw = np.empty(sum(sizes.values()) + align, np.float32)
    buffer = raw[(-raw.ctypes.data % _ALIGN_BYTES) // 4 :]
    views, offset = {}, 0
    for path, x in sorted(shapes.items(), key=lambda item: str(item[0])):
        size = int(np.prod(x.shape))
        views[path], offset = buffer[offset : offset + size].reshape(x.shape), offset + sizes[path]
    return views


def from_marian_tensors(
    config: Any,
    tensors: Iterable[tuple[str, np.ndarray]],
    where: Path,
    *,
    position_keys: Sequence[str] = POSITION_KEYS,
    positions: Callable[[int, int], np.ndarray] = marian_positions,
    architecture: str = "MarianMTModel",
) -> dict:
    """Our parameters (a pure dict of float32 arrays, _aligned_buffers) from the (name, array) pairs of a model of
    `table`'s names (Marian's, or M2M-100's: m2m100.py), one at a time; ConfigError naming a tensor of `where` that
    is missing, unexpected or of the wrong shape. A saved sinusoid table (`position_keys`) must equal
    `positions(rows, d_model)`: the model computes its own."""
    spec = TransformerSpec.from_config(config)
    model = nnx.eval_shape(lambda: build_model(config, rngs=model_rngs(0)))  # shapes only
    shapes = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    entries = {entry.marian: entry for entry in table(spec)}
    tied = aliases(spec)
    if set(shapes) != {entry.ours for entry in entries.values()}:  # the table and the model disagree: a bug
        raise AssertionError(f"mapping table and model differ: {set(shapes) ^ {e.ours for e in entries.values()}}")
    views = _aligned_buffers(shapes)
    params: dict[tuple, np.ndarray] = {}
    copies: dict[str, np.ndarray] = {}

    def put(entry: Entry, array: np.ndarray) -> None:
        np.copyto(views[entry.ours], from_marian(entry, array, shapes[entry.ours].shape, copy=False))
        params[entry.ours] = views[entry.ours]

    for name, array in tensors:
        if name in entries:
            put(entries[name], array)
        elif name in tied:
            copies[name] = array
        elif name in position_keys:
            expected = positions(array.shape[0], spec.d_model)
            if array.shape != expected.shape or not np.allclose(array, expected, atol=1e-5):
                raise ConfigError(
                    f"{where}: tensor {name} is not {architecture}'s sinusoidal table (learned positions?); it "
                    "cannot be converted"
                )
        else:
            raise ConfigError(f"{where}: unexpected tensor {name}; not a {architecture} of this config.json")
        del array
    for name, original in tied.items():
        if original in entries and entries[original].ours not in params and name in copies:
            put(entries[original], copies.pop(name))  # only the tied copy was saved
    for name, copy in copies.items():
        entry = entries[tied[name]]
        if not np.array_equal(from_marian(entry, copy, shapes[entry.ours].shape), params[entry.ours]):
            raise ConfigError(
                f"{where}: tensor {name} differs from {tied[name]} but config.json ties them; the weights are not "
                "those of this config"
            )
    bias = ("final_logits_bias_V",)
    if bias in shapes and bias not in params:  # transformers leaves it out when it is zero
        params[bias] = views[bias]
        params[bias][...] = 0.0
    missing = [entry.marian for entry in entries.values() if entry.ours not in params]
    if missing:
        raise ConfigError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    return unflatten_dict(params)


def marian_tensors(model: Any) -> dict[str, np.ndarray]:
    """Marian's state dict (name -> float32 array) of a model of ours (check_exportable first)."""
    spec = model.spec
    flat = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    perm = permutation(spec.d_model) if spec.sinusoid_layout == "interleaved" else None
    tensors = {
        e.marian: to_marian(e, np.asarray(flat[e.ours], np.float32), perm) for e in table(spec) if e.ours in flat
    }
    if "final_logits_bias" not in tensors:  # model.final_logits_bias=False: the bias is zero
        tensors["final_logits_bias"] = np.zeros((1, spec.vocab_size), np.float32)
    return tensors


def epsilon_logit_difference(model: Any, token_ids: Sequence[Sequence[int]]) -> float:
    """The largest |logit difference| between the model and the same parameters with LayerNorm epsilon 1e-5
    (transformers' Marian), decoding each of `token_ids` as source and, after BOS, as forced target."""
    graph, state = nnx.split(model)
    fixed = nnx.merge(graph, state)
    for _, module in nnx.iter_modules(fixed):
        if isinstance(module, LayerNorm):
            module.epsilon = NORM_EPSILON
    largest = 0.0
    for ids in token_ids:
        src = jnp.asarray([list(ids)], jnp.int32)
        tgt = jnp.asarray([[model.spec.bos_id, *ids[:-1]]], jnp.int32)
        ours = model.decode(model.encode(src), tgt, src_tokens=src)
        theirs = fixed.decode(fixed.encode(src), tgt, src_tokens=src)
        largest = max(largest, float(jnp.max(jnp.abs(ours - theirs))))
    return largest


# -- configs -----------------------------------------------------------------------------------------------------

# config.json keys of the BART-era MarianConfig that transformers' Marian no longer reads, with the only value
# its code (and ours) implements: a checkpoint that sets another one was trained as another architecture.
FIXED = {
    "scale_embedding": True,
    "normalize_before": False,
    "normalize_embedding": False,
    "add_final_layer_norm": False,
    "static_position_embeddings": True,
    "add_bias_logits": False,
}


def one_id(hf: Mapping[str, Any], key: str) -> int:
    """config.json's token id under `key` (a list of one id counts); ConfigError otherwise."""
    value = hf.get(key)
    if isinstance(value, list) and len(value) == 1:
        value = value[0]
    if not isinstance(value, int) or isinstance(value, bool):
        raise ConfigError(f"config.json key {key}={value!r}: expected one token id")
    return value


def bart_keys(
    hf: Mapping[str, Any],
    unk_id: int,
    *,
    fixed: Mapping[str, Any],
    activations: Mapping[str, str],
    default_activation: str | None,
    target_rows: int,
) -> dict[str, Any]:
    """The model.* keys (dotted) every BART-family config.json (Marian's, M2M-100's) gives the same way, after the
    checks they share: the `fixed` keys at their one value, encoder and decoder heads and FFN widths equal, an
    activation of `activations`, positive sizes, d_model even (at least 4) and divisible by the heads, the special
    ids inside `target_rows`. ConfigError naming the first key we cannot represent."""
    for key, value in fixed.items():
        if key in hf and hf[key] != value:
            raise ConfigError(f"config.json key {key}={hf[key]!r}: only {value!r} is supported")
    for a, b in (("encoder_attention_heads", "decoder_attention_heads"), ("encoder_ffn_dim", "decoder_ffn_dim")):
        if hf.get(a) != hf.get(b):
            raise ConfigError(f"config.json keys {a}={hf.get(a)!r} and {b}={hf.get(b)!r} differ; ours are one value")
    activation = hf.get("activation_function", default_activation)
    if activation not in activations:
        raise ConfigError(
            f"config.json key activation_function={activation!r} is not supported; supported: {sorted(activations)}"
        )
    for key in ("d_model", "encoder_attention_heads", "encoder_ffn_dim", "vocab_size"):
        if not isinstance(hf.get(key), int) or hf[key] < 1:
            raise ConfigError(f"config.json key {key}={hf.get(key)!r}: expected a positive integer")
    if hf["d_model"] % hf["encoder_attention_heads"] or hf["d_model"] % 2 or hf["d_model"] < 4:
        raise ConfigError(
            f"config.json key d_model={hf['d_model']} must be even, at least 4 and divisible by "
            f"encoder_attention_heads={hf['encoder_attention_heads']}"
        )
    ids = {key: one_id(hf, key) for key in ("pad_token_id", "eos_token_id", "decoder_start_token_id")}
    for key, value in ids.items():
        if not 0 <= value < target_rows:
            raise ConfigError(f"config.json key {key}={value} is outside the target vocabulary of {target_rows}")
    return {
        "model.vocab_size": target_rows,
        "model.d_model": hf["d_model"],
        "model.num_heads": hf["encoder_attention_heads"],
        "model.num_kv_heads": 0,
        "model.qk_head_dim": 0,
        "model.v_head_dim": 0,
        "model.d_ff": hf["encoder_ffn_dim"],
        "model.num_encoder_layers": int(hf.get("encoder_layers", 0)),
        "model.num_decoder_layers": int(hf.get("decoder_layers", 0)),
        "model.dropout_rate": float(hf.get("dropout", 0.1)),
        "model.attention_dropout_rate": float(hf.get("attention_dropout", 0.0)),
        "model.ffn_dropout_rate": float(hf.get("activation_dropout", 0.0)),
        "model.activation": activations[activation],
        "model.norm": "layernorm",
        "model.norm_epsilon": NORM_EPSILON,
        "model.positional": "sinusoidal",
        "model.max_len": int(hf.get("max_position_embeddings", 1024)),
        "model.pad_id": ids["pad_token_id"],
        "model.eos_id": ids["eos_token_id"],
        "model.bos_id": ids["decoder_start_token_id"],
        "model.unk_id": unk_id,
    }


def model_keys(hf: Mapping[str, Any], unk_id: int) -> dict[str, Any]:
    """Our model.* keys (dotted) for a Marian config.json and the <unk> id of its vocab.json; ConfigError naming the
    first key we cannot represent."""
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    rows = hf.get("vocab_size")
    target_rows = rows if shared or not isinstance(rows, int) else int(hf.get("decoder_vocab_size") or rows)
    keys = bart_keys(hf, unk_id, fixed=FIXED, activations=ACTIVATIONS, default_activation=None, target_rows=target_rows)
    return {
        **keys,
        "model.source_vocab_size": 0 if shared else hf["vocab_size"],
        "model.norm_position": "post",
        "model.sinusoid_layout": "concatenated",
        "model.share_embeddings": shared,
        "model.tie_output": bool(hf.get("tie_word_embeddings", True)),
        "model.final_logits_bias": True,
    }


# generation_config.json key -> our eval key. generate() divides a beam's log-probability by
# length ** length_penalty: our `average` penalty (evaluate.py --length_penalty average) with alpha = length_penalty.
GENERATION_KEYS = {"num_beams": "beam_size", "length_penalty": "alpha"}
# generate()'s max_length counts the decoder's start token, eval.max_len only the output's tokens (EOS included).
START_TOKEN = 1


def eval_keys(generation: Mapping[str, Any]) -> dict[str, Any]:
    """config.eval keys (dotted) from generation_config.json."""
    keys = {}
    for theirs, ours in GENERATION_KEYS.items():
        if generation.get(theirs) is not None:
            keys[f"eval.{ours}"] = (float if ours == "alpha" else int)(generation[theirs])
    if generation.get("max_length") is not None:
        keys["eval.max_len"] = max(int(generation["max_length"]) - START_TOKEN, 1)
    return keys


def check_exportable(config: Any) -> None:
    """ConfigError naming every key of `config` that Marian cannot represent, or nothing."""
    m, d_head = config.model, config.model.d_model // config.model.num_heads
    checks = (
        (m.norm_position != "post", f"model.norm_position={m.norm_position!r} (Marian is post-LN)"),
        (m.norm != "layernorm", f"model.norm={m.norm!r} (Marian has LayerNorm)"),
        (m.activation not in EXPORT_ACTIVATIONS, f"model.activation={m.activation!r} (Marian's FFN is not gated)"),
        (m.num_kv_heads not in (0, m.num_heads), f"model.num_kv_heads={m.num_kv_heads} (grouped-query heads)"),
        (m.qk_head_dim not in (0, d_head), f"model.qk_head_dim={m.qk_head_dim} (Marian's heads are d_model/h)"),
        (m.v_head_dim not in (0, d_head), f"model.v_head_dim={m.v_head_dim} (Marian's heads are d_model/h)"),
        (m.positional != "sinusoidal", f"model.positional={m.positional!r} (Marian's positions are sinusoidal)"),
        (
            m.sinusoid_layout == "fairseq",
            "model.sinusoid_layout='fairseq' (Marian's sinusoids have other frequencies: interleaved or concatenated)",
        ),
        (m.position_offset != 0, f"model.position_offset={m.position_offset} (Marian's positions start at 0)"),
        (not m.tie_output, "model.tie_output=False (the output layer must be the target embedding)"),
        (config.attention.window != 0, f"attention.window={config.attention.window} (Marian attends everywhere)"),
    )
    reasons = [reason for bad, reason in checks if bad]
    if reasons:
        raise ConfigError("cannot export to Marian: " + "; ".join(reasons))


def marian_config(config: Any) -> dict[str, Any]:
    """config.json of MarianMTModel for a config of ours (check_exportable first)."""
    m = config.model
    shared = bool(m.share_embeddings)
    return {
        "architectures": ["MarianMTModel"],
        "model_type": MODEL_TYPE,
        "vocab_size": m.vocab_size if shared else (m.source_vocab_size or m.vocab_size),
        "decoder_vocab_size": m.vocab_size,
        "share_encoder_decoder_embeddings": shared,
        "tie_word_embeddings": True,
        "d_model": m.d_model,
        "encoder_layers": m.num_encoder_layers,
        "decoder_layers": m.num_decoder_layers,
        "encoder_attention_heads": m.num_heads,
        "decoder_attention_heads": m.num_heads,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": EXPORT_ACTIVATIONS[m.activation],
        "dropout": m.dropout_rate,
        "attention_dropout": m.attention_dropout_rate,
        "activation_dropout": m.ffn_dropout_rate,
        "max_position_embeddings": m.max_len,
        "scale_embedding": True,
        "pad_token_id": m.pad_id,
        "eos_token_id": m.eos_id,
        "forced_eos_token_id": m.eos_id,
        "decoder_start_token_id": m.bos_id,
        "is_encoder_decoder": True,
    }


def generation_config(config: Any) -> dict[str, Any]:
    """generation_config.json: our evaluation's beam size, length penalty exponent and length cap (generate()'s
    default is 20 tokens: eval.max_len and the start token, or every position), and the pad id never generated (nor
    by our searches)."""
    m, e = config.model, config.eval
    return {
        "decoder_start_token_id": m.bos_id,
        "eos_token_id": m.eos_id,
        "forced_eos_token_id": m.eos_id,
        "pad_token_id": m.pad_id,
        "bad_words_ids": [[m.pad_id]],
        **{theirs: e[ours] for theirs, ours in GENERATION_KEYS.items()},
        "max_length": e.max_len + START_TOKEN if e.max_len else m.max_len,
    }
