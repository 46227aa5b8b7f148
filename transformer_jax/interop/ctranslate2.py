"""Export to CTranslate2: the model's weights in a ctranslate2 TransformerSpec, and decoding with our length limits.
Axis letters: see transformer_jax/__init__.py.

The exported directory holds model.bin, config.json, shared_vocabulary.json (row i is our id i's piece, so
CTranslate2's ids are ours) and the tokenizer, everything a server needs: spm.model, or a converted M2M-100 /
NLLB-200 model's files (data.tokenizer=fairseq: sentencepiece.bpe.model, vocab.json, and TOKENIZER_KEYS, the config
keys its tokenizer is built from: `exported_tokenizer` reads them). How our layers map onto the engine's, each
checked by tests/test_export.py against decoding.Searcher's outputs and the model's logits:
- Kernels [in, out] are the engine's [out, in] weights. Self-attention's Q, K, V are one fused linear [Q; K; V];
  cross-attention has Q and a fused [K; V]. Heads are consecutive column blocks on both sides, and with grouped
  key/value heads query head n reads key/value head n // G on both sides.
- post-LN is CTranslate2's pre_norm=False (no final norm); pre-LN adds the final encoder and decoder norms. The
  norm epsilon is config.json's layer_norm_epsilon.
- Positions are an explicit table added after the embedding * sqrt(d_model), as CTranslate2's own Marian loader
  writes Marian's: ours in model.sinusoid_layout (fairseq's included) for `max_positions` positions, a learned table
  as it is, and positional=none as zeros; each from model.position_offset on, as its M2M-100 loader writes
  fairseq's. swish is the engine's SWISH without GLU, swiglu with GLU; final_logits_bias is the output projection's
  bias, where CTranslate2's Marian loader puts Marian's.
- Sources end with EOS (add_source_eos), as in training; decoding starts from BOS (decoder_start_token, which may
  be EOS, as fairseq's) and stops at an emitted EOS.
- Weights are float32, as trained, unless `quantization` (QUANTIZATIONS, CTranslate2's own) asks otherwise; the
  engine picks its compute type at load time. A model.dtype=bfloat16 model decodes in bfloat16 here, so its
  outputs may differ from the engine's float32 ones.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections import Counter, defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np

from transformer_jax.data import languages
from transformer_jax.data.tokenizer import MODEL_FILENAME, FairseqTokenizer, Tokenizer
from transformer_jax.decoding.state import length_penalty
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice
from transformer_jax.evaluation.translate import (
    EMPTY,
    DecodeSettings,
    Hypothesis,
    LanguageIds,
    input_limit,
    language_tokens,
    output_cap,
    output_limit,
    sources_of,
)
from transformer_jax.evaluation.translate import position_limit as learned_positions
from transformer_jax.interop import folders
from transformer_jax.interop.folders import vocabulary
from transformer_jax.model.layers import SpecialIds, TransformerSpec, sinusoidal_encoding

# CTranslate2's translate_batch defaults: inputs cut at 1024 tokens, outputs at 256. A table covering both lets
# the exported model serve with the engine's defaults (positions beyond the table are an error in the engine).
ENGINE_DEFAULT_POSITIONS = 1024
# CTranslate2's weight quantizations the export offers (ctranslate2.specs.ModelSpec.optimize); None = float32.
QUANTIZATIONS = ("int8", "int8_float32", "bfloat16")
MARKER = "model.bin"  # what makes a directory an earlier export that --force may replace
TOKENIZER_KEYS = "tokenizer_keys.json"  # a fairseq tokenizer's config keys, beside its files (exported_tokenizer)


def check_exportable(spec: Any) -> None:
    """ConfigError naming every key CTranslate2 cannot express (`spec`: a model.layers.TransformerSpec), or nothing."""
    reasons = []
    if spec.d_qk != spec.d_v:
        reasons.append(
            f"model.qk_head_dim={spec.d_qk} differs from model.v_head_dim={spec.d_v}: CTranslate2 has one head size"
        )
    if spec.window:
        reasons.append(
            f"attention.window={spec.window}: CTranslate2 attends to every position (its sliding_window keeps the "
            "last tokens of the decoder's cache, another rule)"
        )
    if reasons:
        raise ConfigError("cannot export to CTranslate2: " + "; ".join(reasons))


def position_table(model: Any, max_positions: int, target: bool) -> np.ndarray:
    """[P, D] float32: the positional encoding added at positions 0 .. P-1, each shifted by model.position_offset (the
    engine's row p is the model's position p + offset, as CTranslate2's own M2M-100 loader writes fairseq's table
    from its offset on; a learned table: its rows from the offset on)."""
    spec = model.spec
    if spec.positional == "learned":
        table = model.tgt_positions if target else model.src_positions
        return _array(table.table_LD)[spec.position_offset :]
    if spec.positional == "none":
        return np.zeros((max_positions, spec.d_model), np.float32)
    positions_1P = spec.position_offset + jnp.arange(max_positions, dtype=jnp.int32)[None]
    return np.array(sinusoidal_encoding(positions_1P, spec.d_model, spec.sinusoid_layout)[0], np.float32)


def _array(param: Any) -> np.ndarray:
    # A writable copy: CTranslate2's int8 quantization scales the arrays in place (a jax buffer's view is read-only).
    return np.array(param[...], np.float32)


def _set_linear(ct2_linear: Any, *layers: Any) -> None:
    """CTranslate2 linear = our nnx.Linear layers side by side on the output axis, as [out, in] (+ bias)."""
    ct2_linear.weight = np.concatenate([_array(layer.kernel).T for layer in layers], axis=0)
    if layers[0].bias is not None:
        ct2_linear.bias = np.concatenate([_array(layer.bias) for layer in layers], axis=0)


def _set_norm(ct2_norm: Any, norm: Any) -> None:
    ct2_norm.gamma = _array(norm.scale_D)
    if hasattr(norm, "bias_D"):  # LayerNorm; RMSNorm has a scale only
        ct2_norm.beta = _array(norm.bias_D)


def build_spec(model: Any, pieces: Sequence[str], *, max_positions: int) -> Any:
    """The ctranslate2.specs.TransformerSpec holding the model's parameters and the vocabulary `pieces`."""
    from ctranslate2.specs import common_spec, transformer_spec  # optional: pip install -e .[ctranslate2]

    spec = model.spec
    activation = {
        "relu": common_spec.Activation.RELU,
        "gelu": common_spec.Activation.GELUTanh,  # jax.nn.gelu's default is the tanh approximation
        "swiglu": common_spec.Activation.SWISH,  # Swish = SiLU
        "swish": common_spec.Activation.SWISH,  # not gated: ffn_glu below is swiglu's alone
    }[spec.activation]
    common = dict(
        num_heads=spec.num_heads,
        pre_norm=spec.norm_position == "pre",
        activation=activation,
        ffn_glu=spec.activation == "swiglu",
        rms_norm=spec.norm == "rmsnorm",
        num_heads_kv=spec.heads_kv if spec.heads_kv != spec.num_heads else None,
        head_dim=spec.d_qk,
    )
    encoder = transformer_spec.TransformerEncoderSpec(spec.num_encoder_layers, **common)
    decoder = transformer_spec.TransformerDecoderSpec(spec.num_decoder_layers, **common)
    ct2 = transformer_spec.TransformerSpec(encoder, decoder)

    src_table = _array(model.src_embed.table_VD)
    tgt_table = src_table if model.tgt_embed is None else _array(model.tgt_embed.table_VD)
    encoder.embeddings[0].weight = src_table
    encoder.position_encodings.encodings = position_table(model, max_positions, target=False)
    decoder.embeddings.weight = tgt_table
    decoder.position_encodings.encodings = position_table(model, max_positions, target=True)
    # Tied output: logits = y E^T, i.e. a linear layer whose [out, in] weight is E itself.
    decoder.projection.weight = tgt_table if model.output_proj is None else _array(model.output_proj.kernel).T
    if model.final_logits_bias_V is not None:
        decoder.projection.bias = _array(model.final_logits_bias_V)
    if spec.norm_position == "pre":
        _set_norm(encoder.layer_norm, model.encoder_norm)
        _set_norm(decoder.layer_norm, model.decoder_norm)

    encoder_layers = zip(encoder.layer, model.encoder_layers, strict=True)
    for ct2_layer, layer in [*encoder_layers, *zip(decoder.layer, model.decoder_layers, strict=True)]:
        attn = layer.self_attn
        _set_norm(ct2_layer.self_attention.layer_norm, layer.self_attn_residual.norm)
        _set_linear(ct2_layer.self_attention.linear[0], attn.q_proj, attn.k_proj, attn.v_proj)
        _set_linear(ct2_layer.self_attention.linear[1], attn.o_proj)
        if hasattr(layer, "cross_attn"):  # a decoder layer
            cross = layer.cross_attn
            _set_norm(ct2_layer.attention.layer_norm, layer.cross_attn_residual.norm)
            _set_linear(ct2_layer.attention.linear[0], cross.q_proj)
            _set_linear(ct2_layer.attention.linear[1], cross.k_proj, cross.v_proj)
            _set_linear(ct2_layer.attention.linear[2], cross.o_proj)
        _set_norm(ct2_layer.ffn.layer_norm, layer.ffn_residual.norm)
        _set_linear(ct2_layer.ffn.linear_0, layer.ffn.w1)  # the activated half: max(0, x W1), GELU(x W1), Swish(x W1)
        if layer.ffn.w3 is not None:
            _set_linear(ct2_layer.ffn.linear_0_noact, layer.ffn.w3)  # SwiGLU's linear half
        _set_linear(ct2_layer.ffn.linear_1, layer.ffn.w2)

    ct2.config.layer_norm_epsilon = spec.norm_epsilon
    ct2.config.unk_token = pieces[spec.unk_id]
    ct2.config.bos_token = pieces[spec.bos_id]
    ct2.config.eos_token = pieces[spec.eos_id]
    ct2.config.decoder_start_token = pieces[spec.bos_id]
    ct2.config.add_source_eos = True
    ct2.register_source_vocabulary(list(pieces))
    ct2.register_target_vocabulary(list(pieces))
    return ct2


def check_quantization(quantization: str | None) -> None:
    """EvalError unless `quantization` is None (float32) or one of QUANTIZATIONS."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise EvalError(f"--quantization {quantization!r}: choose one of {list(QUANTIZATIONS)}, or none for float32")


def to_ctranslate2(
    model: Any,
    tokenizer: Any,
    output_dir: str | os.PathLike,
    *,
    max_positions: int = ENGINE_DEFAULT_POSITIONS,
    quantization: str | None = None,
    force: bool = False,
) -> Path:
    """Writes the model and its tokenizer as a CTranslate2 directory, whole or not at all (an existing one only with
    `force`). `max_positions`: rows of the sinusoidal position table, the longest input and output the engine can
    then decode. `quantization`: one of QUANTIZATIONS, or None for float32."""
    output_dir = Path(output_dir)
    check_exportable(model.spec)
    check_quantization(quantization)
    folders.check_output(output_dir, force, MARKER, "a CTranslate2 model directory")
    if tokenizer.name not in ("spm", "fairseq"):  # the tokenizers whose files the export ships
        raise EvalError(
            f"the CTranslate2 export needs a joint vocabulary (data.tokenizer='spm' or 'fairseq'), not "
            f"{tokenizer.name!r}; export a converted Marian model with --format marian"
        )
    pieces = vocabulary(tokenizer, model.spec.vocab_size)
    twice = sorted(piece for piece, n in Counter(pieces).items() if n > 1)
    if twice:  # the engine maps pieces to ids: each must name one row
        raise EvalError(f"tokenizer {tokenizer.path} names several ids {twice[:3]}; each piece must name one id")
    ct2 = build_spec(model, pieces, max_positions=max_positions)
    ct2.validate()
    ct2.optimize(quantization=quantization)  # None: float32, as trained; the engine converts at load time

    def fill(tmp: Path) -> None:
        ct2.save(str(tmp))
        if tokenizer.name == "spm":
            shutil.copyfile(tokenizer.path, tmp / MODEL_FILENAME)  # the name a workdir gives it
            return
        for file in tokenizer.files:  # the names a converted workdir gives them
            shutil.copyfile(file, tmp / file.name)
        (tmp / TOKENIZER_KEYS).write_text(json.dumps(tokenizer_keys(tokenizer), indent=1) + "\n", encoding="utf-8")

    return folders.write_into_place(output_dir, fill)


def tokenizer_keys(tokenizer: FairseqTokenizer) -> dict[str, Any]:
    """The config keys a fairseq tokenizer is built from (data/tokenizer.py get_tokenizer), as TOKENIZER_KEYS holds
    them."""
    ids = tokenizer.ids
    return {
        "data.tokenizer": tokenizer.name,
        "model.vocab_size": tokenizer.vocab_size,
        **{f"model.{field}_id": getattr(ids, field) for field in ("pad", "eos", "bos", "unk")},
        "model.lang_token": tokenizer.language_table.scheme,
        "model.language_codes": sorted(tokenizer.language_table.ids.items(), key=lambda code: code[1]),
    }


def exported_tokenizer(directory: str | os.PathLike) -> Any:
    """The tokenizer an export ships: a fairseq one (TOKENIZER_KEYS and its files), or spm.model with the default
    reserved ids."""
    directory = Path(directory)
    if not (directory / TOKENIZER_KEYS).is_file():
        return Tokenizer(directory / MODEL_FILENAME, SpecialIds.DEFAULT)
    keys = json.loads((directory / TOKENIZER_KEYS).read_text(encoding="utf-8"))
    ids = SpecialIds(*(keys[f"model.{field}_id"] for field in ("pad", "eos", "bos", "unk")))
    table = languages.Placement(keys["model.lang_token"], {code: int(i) for code, i in keys["model.language_codes"]})
    return FairseqTokenizer(directory, ids, keys["model.vocab_size"], table)


# -- decoding with our limits ---------------------------------------------------------------------------------


def ctranslate2_translate(
    translator: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    settings: DecodeSettings,
    *,
    position_limit: int | None = None,
    language_ids: LanguageIds | Sequence[LanguageIds] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """evaluation.translate.translate's outputs and statistics, decoded by a ctranslate2.Translator of an export.

    A multilingual model's directions (`language_ids`, as translate takes them: one, or one per sentence): the source
    language token starts each source, and the forced target token is the engine's `target_prefix`, one output slot
    as in ours; the other language tokens are `suppress_sequences`, as our search bars them; the tokenizer's decode
    drops them.

    The sources, their cut and each output's limit are translate()'s (source_ids, output_limit; `position_limit`
    is position_limit(model.spec)). The engine's max_decoding_length counts the EOS it stops at, as our limit does,
    but is one number per call: greedy search decodes each sentence independently of its limit, so one call with the
    largest limit, each output then cut to its own, gives exactly the per-sentence outputs; beam search's result
    depends on when hypotheses must finish, so it makes one call per distinct limit. min_decoding_length=0 lets an
    output be EOS alone, as ours can; max_input_length=0 keeps our cut. alpha goes to the engine's length_penalty
    (GNMT's formula, not decoding/state.py's), so only greedy outputs are expected to be identical.
    """
    start = time.perf_counter()
    _, outs, _, stats = _decode(translator, tokenizer, sentences, settings, position_limit, language_ids)
    outputs = [""] * len(sentences)
    for i, out in outs.items():
        outputs[i] = tokenizer.decode_target([t for t in out if t not in (tokenizer.ids.eos, tokenizer.ids.pad)])
    return outputs, {**stats, "seconds": round(time.perf_counter() - start, 3)}


def ctranslate2_hypotheses(
    translator: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    settings: DecodeSettings,
    *,
    position_limit: int | None = None,
    language_ids: LanguageIds | Sequence[LanguageIds] | None = None,
) -> tuple[list[Hypothesis], dict[str, Any]]:
    """ctranslate2_translate's outputs as translate_nbest's 1-best Hypothesis records (EMPTY for a blank line), with
    the statistics. log_prob is the engine's score_batch of the output: its per-token log-probabilities summed, EOS's
    where the output emitted it, a forced target language token's left out (it adds 0 in ours); score is log_prob /
    lp(length) by settings.search's length penalty (decoding.length_penalty), the length counting the forced token
    and EOS, as ours does."""
    start = time.perf_counter()
    sources, outs, lang, stats = _decode(translator, tokenizer, sentences, settings, position_limit, language_ids)
    pieces, eos = vocabulary(tokenizer), tokenizer.ids.eos
    rows = sorted(outs)
    ended = {i: bool(outs[i]) and outs[i][-1] == eos for i in rows}
    scored = translator.score_batch(
        [[pieces[t] for t in sources[i][:-1]] for i in rows],  # the engine adds EOS to sources and targets
        [[pieces[t] for t in (outs[i][:-1] if ended[i] else outs[i])] for i in rows],
        max_batch_size=settings.batch_size,
        max_input_length=0,
    )
    search = settings.search
    hypotheses = [EMPTY] * len(sentences)
    for i, result in zip(rows, scored, strict=True):
        log_probs = np.asarray(result.log_probs, np.float32)[: None if ended[i] else -1]  # EOS's only if emitted
        log_prob = float(np.sum(log_probs[0 if lang[i].target is None else 1 :]))
        length = len(outs[i])
        score = float(log_prob / length_penalty(length, search.alpha, search.penalty))
        text = tokenizer.decode_target([t for t in outs[i] if t not in (eos, tokenizer.ids.pad)])
        hypotheses[i] = Hypothesis(text, log_prob, score, length, ended[i])
    return hypotheses, {**stats, "seconds": round(time.perf_counter() - start, 3)}


def _decode(
    translator: Any,
    tokenizer: Any,
    sentences: Sequence[str],
    settings: DecodeSettings,
    position_limit: int | None,
    language_ids: LanguageIds | Sequence[LanguageIds] | None,
) -> tuple[dict[int, list[int]], dict[int, list[int]], list[LanguageIds], dict[str, Any]]:
    """(sources, each decoded line's output ids cut to its limit (the forced language token first, EOS last where
    emitted), each line's LanguageIds, the statistics but seconds): ctranslate2_translate's search."""
    beam_size, eos = settings.search.beam_size, tokenizer.ids.eos
    pieces = vocabulary(tokenizer)
    index = {piece: i for i, piece in enumerate(pieces)}
    lang = LanguageIds.per_line(language_ids, len(sentences))
    limit = input_limit(settings.max_input_len, position_limit)
    sources, truncated_lines = sources_of(
        tokenizer, sentences, limit, [[] if x.source is None else [x.source] for x in lang]
    )
    target_prefix = None if all(x.target is None for x in lang) else [[pieces[x.target]] for x in lang]
    barred = [[pieces[t]] for t in language_tokens(tokenizer)] or None
    cap = output_cap(settings.max_len, position_limit)
    limits = {i: output_limit(len(ids), settings.max_extra_len, cap) for i, ids in sources.items()}
    longest, groups = max(limits.values(), default=0), defaultdict(list)
    for i in sorted(sources):
        groups[longest if beam_size == 1 else limits[i]].append(i)
    outs, tgt_tokens, hit_max_len = {}, 0, 0
    for group_limit, rows in sorted(groups.items()):
        results = translator.translate_batch(
            [[pieces[t] for t in sources[i][:-1]] for i in rows],  # the engine adds EOS (add_source_eos)
            max_batch_size=settings.batch_size,
            beam_size=beam_size,
            length_penalty=settings.search.alpha,
            max_input_length=0,
            max_decoding_length=int(group_limit),
            target_prefix=None if target_prefix is None else [target_prefix[i] for i in rows],
            suppress_sequences=barred,
            min_decoding_length=0,
            return_end_token=True,
        )
        for i, result in zip(rows, results, strict=True):
            outs[i] = [index[piece] for piece in result.hypotheses[0]][: limits[i]]
            tgt_tokens += len(outs[i])
            hit_max_len += not (outs[i] and outs[i][-1] == eos)  # stopped by the length limit, not by EOS
    stats = {
        "sentences": len(sentences),
        "empty": len(sentences) - len(sources),
        "truncated": len(truncated_lines),
        "truncated_lines": truncated_lines[:100],
        "hit_max_len": hit_max_len,
        "src_tokens": int(sum(len(s) for s in sources.values())),
        "tgt_tokens": tgt_tokens,
    }
    return sources, outs, lang, stats


# -- a workdir's checkpoints --------------------------------------------------------------------------------------


def export_workdir(
    workdir: str,
    output_dir: str | os.PathLike,
    *,
    config: Any = None,
    choice: CheckpointChoice = LATEST,
    quantization: str | None = None,
    force: bool = False,
) -> dict[str, Any]:
    """Exports the checkpoints evaluate.py would use (same flags, same selection and averaging); returns a report.
    Everything cheap (flags, output directory, checkpoints, the engine and the architecture) is checked before the
    parameters are read."""
    choice = check_choice(choice)
    check_quantization(quantization)
    output_dir = Path(output_dir)
    folders.check_output(output_dir, force, MARKER, "a CTranslate2 model directory")
    try:
        import ctranslate2  # noqa: F401 - only to fail before the parameters are read
    except ImportError as e:
        raise EvalError(f"ctranslate2 is not installed ({e}); pip install ctranslate2==4.8.5") from e
    config, model, steps, tokenizer = folders.restore_checked(
        workdir, config, choice, lambda c: check_exportable(TransformerSpec.from_config(c))
    )
    # Room for evaluate.py's longest decode (eval_max_len source tokens + max_extra_len) and the engine's defaults.
    max_positions = max(ENGINE_DEFAULT_POSITIONS, config.data.eval_max_len + config.eval.max_extra_len)
    to_ctranslate2(model, tokenizer, output_dir, max_positions=max_positions, quantization=quantization, force=force)
    return {
        "output": str(output_dir),
        "format": "ctranslate2",
        "quantization": quantization or "float32",
        "workdir": str(workdir),
        "checkpoint_steps": steps,
        "max_positions": learned_positions(model.spec) or max_positions,
        "eval": {
            "max_extra_len": config.eval.max_extra_len,
            "max_len": config.eval.max_len,
            "eval_max_len": config.data.eval_max_len,
        },
    }
