"""Hugging Face M2M-100 and dense NLLB-200 <-> our Transformer: their config.json as our model keys (the parameter
names are marian.py's table: both are transformers' BART family). m2m100_folder.py reads the folders.

How transformers' M2M100ForConditionalGeneration (models/m2m_100/modeling_m2m_100.py; NLLB-200's dense models are
the same class) maps onto model/transformer.py:
- Pre-LN: each block normalises its input (self_attn_layer_norm, encoder_attn_layer_norm, final_layer_norm before
  the FFN), and each stack ends in a norm of its own (model.encoder.layer_norm, model.decoder.layer_norm): our
  model.norm_position=pre with its encoder_norm and decoder_norm. LayerNorm epsilon 1e-5 (nn.LayerNorm's default).
- Embeddings shared by encoder, decoder and output layer (model.shared.weight, lm_head tied), scaled by
  sqrt(d_model) when scale_embedding is true; no final_logits_bias.
- Positions: fairseq's sinusoids (model.sinusoid_layout=fairseq) at padding_idx + 1 + i for token i of a sequence
  without padding inside it (model.position_offset = pad_token_id + 1); the table is a buffer transformers does not
  save (a saved one is checked, as Marian's).
- fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; decoding starts from </s> (decoder_start_token_id 2 =
  model.bos_id = model.eos_id). Sources are `[src_code] X </s>` and targets `[tgt_code] Y </s>`: our
  model.lang_token=source_and_target with the code table model.language_codes (m2m100_vocab.py).
- transformers' layerdrop (encoder_layerdrop, decoder_layerdrop) skips whole layers at random in training; ours
  never does, so a fine-tuning run here trains without it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from transformer_jax.interop import marian

MODEL_TYPE = "m2m_100"
NORM_EPSILON = marian.NORM_EPSILON  # nn.LayerNorm's default, as in Marian
ACTIVATIONS = {"relu": "relu", "swish": "swish", "silu": "swish", "gelu_new": "gelu", "gelu_pytorch_tanh": "gelu"}
POSITION_KEYS = ("model.encoder.embed_positions.weights", "model.decoder.embed_positions.weights")
ARCHITECTURE = "M2M100ForConditionalGeneration"
# config.json keys with the only value transformers' M2M100 code (and ours) implements.
FIXED = {"scale_embedding": True, "tie_word_embeddings": True, "is_encoder_decoder": True}


def fairseq_positions(num_positions: int, d_model: int, padding_idx: int) -> np.ndarray:
    """[P, D] float32: the table M2M100SinusoidalPositionalEmbedding.get_embedding builds (row p holds position p;
    the padding row is zero), computed in numpy: what a saved table is checked against."""
    half = d_model // 2
    inv_freq = np.exp(np.arange(half, dtype=np.float32) * -np.float32(np.log(10000.0) / (half - 1)))
    angles = np.arange(num_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    table = np.concatenate([np.sin(angles), np.cos(angles)], axis=1).astype(np.float32)
    table[padding_idx] = 0.0
    return table


def model_keys(hf: Mapping[str, Any], unk_id: int) -> dict[str, Any]:
    """Our model.* keys (dotted) for an M2M-100 / NLLB-200 config.json and the <unk> id of its vocabulary;
    ConfigError naming the first key we cannot represent."""
    rows = hf.get("vocab_size")
    keys = marian.bart_keys(
        hf, unk_id, fixed=FIXED, activations=ACTIVATIONS, default_activation="relu", target_rows=rows
    )
    return {
        **keys,
        "model.source_vocab_size": 0,
        "model.norm_position": "pre",
        "model.sinusoid_layout": "fairseq",
        "model.position_offset": keys["model.pad_id"] + 1,
        "model.lang_token": "source_and_target",
        "model.share_embeddings": True,
        "model.tie_output": True,
        "model.final_logits_bias": False,
    }


def from_tensors(config: Any, tensors: Any, where: Any) -> dict:
    """Our parameters from an M2M-100 / NLLB-200 folder's (name, array) pairs (marian.from_marian_tensors's rules)."""

    def positions(rows: int, d_model: int) -> np.ndarray:
        return fairseq_positions(rows, d_model, config.model.pad_id)

    return marian.from_marian_tensors(
        config, tensors, where, position_keys=POSITION_KEYS, positions=positions, architecture=ARCHITECTURE
    )
