"""A workdir of ours -> a Hugging Face M2M-100 / NLLB-200 folder (`export_workdir`), the inverse of m2m100_folder.py.

What exports: a converted workdir (data.tokenizer=fairseq, whose ids already are fairseq's) and our own multilingual
models (model.lang_token target or source_and_target, a BPE SentencePiece model, pre-LN with fairseq's sinusoids
from position 2); `check_exportable` names the keys of any other model. The parameter names are marian.py's table.

Ids. fairseq's dictionary is `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the SentencePiece pieces, then the
language codes, then any other row. Our own model's rows are permuted into that order (`own_vocabulary`: our ids are
SentencePiece's, its reserved ones at model.*_id, the languages after the pieces); its languages are named as NLLB-200
spells them (languages.resolve against NLLB_CODES: en -> eng_Latn). The decoder starts from our model.bos_id's new id.

The folder is NLLB's layout: config.json, generation_config.json, model.safetensors (safetensors.numpy: no torch),
sentencepiece.bpe.model, tokenizer.json (`tokenizer_json`: loading needs no protobuf) and tokenizer_config.json
(NllbTokenizer, the codes, legacy_behaviour false). A converted M2M-100 workdir (codes `__en__`) keeps M2M-100's
layout instead (vocab.json, M2M100Tokenizer), which its importer and transformers read back as they were.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from sentencepiece import sentencepiece_model_pb2

from transformer_jax.data import languages
from transformer_jax.data.tokenizer import FAIRSEQ_SPM, FAIRSEQ_VOCAB
from transformer_jax.errors import ConfigError
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice
from transformer_jax.interop import folders, m2m100, m2m100_vocab, marian
from transformer_jax.interop.marian_folder import CONFIG, GENERATION, SAFETENSORS, SAMPLE_SENTENCES, TOKENIZER_CONFIG

FORMAT = "m2m100"
TOKENIZER_JSON = m2m100_vocab.TOKENIZER_JSON
# fairseq's special pieces in id order, with the model.*_id key of each
SPECIALS = {"<s>": "bos", "<pad>": "pad", "</s>": "eos", "<unk>": "unk"}
POSITION_OFFSET = 2  # transformers' M2M-100 numbers positions from padding_idx + 1, and padding_idx is <pad>'s 1
MASK = "<mask>"  # NLLB-200's added token, normalised and stripping the space on its left
# SentencePiece's ModelProto.SentencePiece.Type and TrainerSpec.ModelType values
CONTROL, USER_DEFINED, BPE = 3, 4, 2
M2M100_CODE = re.compile(r"__[a-z]+__")
MADEUP_WORD = re.compile(r"madeupword\d{4}")  # m2m100_vocab.MADEUP_WORD's words


def _languages(config: Any) -> dict[str, str]:
    """Our own model's language suffixes -> their NLLB-200 codes; ConfigError for one it cannot name."""
    names = {}
    for lang in languages.Placement.of(config).ids:
        try:
            names[lang] = languages.resolve(lang, languages.NLLB_CODES)
        except ConfigError as e:
            raise ConfigError(f"cannot export to M2M-100: data.directions language {lang!r}: {e}") from None
    return names


def check_exportable(config: Any) -> None:
    """ConfigError naming every key of `config` that an M2M-100 / NLLB-200 folder cannot hold, or nothing."""
    m, d_head = config.model, config.model.d_model // config.model.num_heads
    own = config.data.tokenizer != "fairseq"
    checks = (
        (m.norm_position != "pre", f"model.norm_position={m.norm_position!r} (M2M-100 is pre-LN)"),
        (m.norm != "layernorm", f"model.norm={m.norm!r} (M2M-100 has LayerNorm)"),
        (
            m.activation not in marian.EXPORT_ACTIVATIONS,
            f"model.activation={m.activation!r} (M2M-100's FFN is not gated)",
        ),
        (m.num_kv_heads not in (0, m.num_heads), f"model.num_kv_heads={m.num_kv_heads} (grouped-query heads)"),
        (m.qk_head_dim not in (0, d_head), f"model.qk_head_dim={m.qk_head_dim} (M2M-100's heads are d_model/h)"),
        (m.v_head_dim not in (0, d_head), f"model.v_head_dim={m.v_head_dim} (M2M-100's heads are d_model/h)"),
        (m.positional != "sinusoidal", f"model.positional={m.positional!r} (M2M-100's positions are sinusoidal)"),
        (m.sinusoid_layout != "fairseq", f"model.sinusoid_layout={m.sinusoid_layout!r} (M2M-100's is fairseq)"),
        (
            m.position_offset != POSITION_OFFSET,
            f"model.position_offset={m.position_offset} (M2M-100's positions start at {POSITION_OFFSET})",
        ),
        (not m.share_embeddings, "model.share_embeddings=False (M2M-100 has one embedding matrix)"),
        (not m.tie_output, "model.tie_output=False (the output layer must be the embedding)"),
        (m.final_logits_bias, "model.final_logits_bias=True (M2M-100 has no output bias)"),
        (config.attention.window != 0, f"attention.window={config.attention.window} (M2M-100 attends everywhere)"),
        (config.data.tokenizer == "marian", "data.tokenizer='marian' (M2M-100's tokenizer is one SentencePiece)"),
        (
            own and config.data.tokenizer_type != "bpe",
            f"data.tokenizer_type={config.data.tokenizer_type!r} (NllbTokenizer is BPE)",
        ),
        (
            own and m.lang_token not in ("target", "source_and_target"),
            f"model.lang_token={m.lang_token!r} (M2M-100 starts each target with its language's code)",
        ),
    )
    reasons = [reason for bad, reason in checks if bad]
    if reasons:
        raise ConfigError("cannot export to M2M-100: " + "; ".join(reasons))
    if own:
        _languages(config)


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    """The exported ids: `tokens` (new id -> token, every id the tokenizer names), `order` (row i of the export is
    our row order[i]; None: our ids already are fairseq's), `codes` (language code -> new id) and the SentencePiece
    model."""

    tokens: dict[int, str]
    order: np.ndarray | None
    codes: dict[str, int]
    spm: Path


def _proto(path: Path) -> Any:
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(path).read_bytes())
    return proto


def own_vocabulary(config: Any, tokenizer: Any) -> Vocabulary:
    """Our own model's ids in fairseq's order (module docstring)."""
    m, proto = config.model, _proto(tokenizer.path)
    if proto.trainer_spec.model_type != BPE:
        raise ConfigError(f"cannot export to M2M-100: {tokenizer.path} is not a BPE SentencePiece model")
    specials = {token: int(m[f"{field}_id"]) for token, field in SPECIALS.items()}
    order = list(specials.values()) + [i for i in range(len(proto.pieces)) if i not in specials.values()]
    tokens = list(specials) + [proto.pieces[i].piece for i in order[len(specials) :]]
    names, first_code = _languages(config), len(tokens)
    for lang, i in sorted(tokenizer.language_table.ids.items(), key=lambda item: item[1]):
        order.append(i)
        tokens.append(names[lang])
    if len(set(tokens)) != len(tokens):
        raise ConfigError(f"cannot export to M2M-100: {tokenizer.path} holds a piece named as a special or a code")
    codes = {tokens[i]: i for i in range(first_code, len(tokens))}
    order += sorted(set(range(m.vocab_size)) - set(order))  # rows no token names (a smaller tokenizer_model's)
    return Vocabulary(dict(enumerate(tokens)), np.asarray(order), codes, tokenizer.path)


def converted_vocabulary(config: Any, workdir: Path) -> Vocabulary:
    """A converted workdir's ids as they are: its vocab.json and code table."""
    vocab = json.loads((workdir / FAIRSEQ_VOCAB).read_text(encoding="utf-8"))
    codes = {code: int(i) for code, i in config.model.language_codes}
    return Vocabulary({i: token for token, i in vocab.items()}, None, codes, workdir / FAIRSEQ_SPM)


def _merges(proto: Any) -> list[list[str]]:
    """The BPE merges of a SentencePiece BPE model: each piece's splits into two pieces, ordered by the merged
    piece's rank, then the halves' lengths (transformers' generate_merges, what its conversion writes)."""
    rank = {p.piece: i for i, p in enumerate(proto.pieces)}
    merges = []
    for piece, i in rank.items():
        splits = [(piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in rank and piece[k:] in rank]
        merges += [(a, b, i) for a, b in sorted(splits, key=lambda ab: (rank[ab[0]], rank[ab[1]]))]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])))
    return [[a, b] for a, b, _ in merges]


def _template(vocab: Vocabulary, source_code: str | None) -> dict[str, Any]:
    """NLLB's TemplateProcessing of sources: `[source_code] X </s>`, or `X </s>` without a code."""
    ids = {"</s>": [_special_ids(vocab)["eos"]]} | (
        {} if source_code is None else {source_code: [vocab.codes[source_code]]}
    )
    single = [{"Sequence": {"id": "A", "type_id": 0}}, {"SpecialToken": {"id": "</s>", "type_id": 0}}]
    pair = [single[0], {"Sequence": {"id": "B", "type_id": 0}}, single[1]]
    if source_code is not None:
        code = {"SpecialToken": {"id": source_code, "type_id": 0}}
        single, pair = [code, *single], [code, *pair]
    return {
        "type": "TemplateProcessing",
        "single": single,
        "pair": pair,
        "special_tokens": {token: {"id": token, "ids": i, "tokens": [token]} for token, i in ids.items()},
    }


def tokenizer_json(vocab: Vocabulary, source_code: str | None) -> dict[str, Any]:
    """tokenizer.json of a `tokenizers` BPE model giving `vocab`'s ids: the SentencePiece pieces (and fairseq's
    specials) as the BPE vocabulary with the model's merges and byte fallback, its normalizer (a converted model's
    precompiled character map, runs of spaces folded where it removes extra whitespace; ours is the identity) and
    the Metaspace pre-tokenizer and decoder (a leading `▁` where it adds a dummy prefix); every other id (specials,
    codes, user-defined pieces) is an added token. The post-processor makes sources `[source_code] X </s>` (`X </s>`
    for None), as NllbTokenizer does, which replaces it with the template of its src_lang."""
    proto = _proto(vocab.spm)
    spec = proto.normalizer_spec
    kinds = {p.piece: p.type for p in proto.pieces}
    ids = sorted(vocab.tokens.items())
    bpe_vocab = {token: i for i, token in ids if token in kinds or token in SPECIALS}
    added = [
        {
            "id": i,
            "content": token,
            "single_word": False,
            "lstrip": token == MASK,
            "rstrip": False,
            "normalized": token == MASK,
            "special": kinds.get(token) != USER_DEFINED,
        }
        for i, token in ids
        if token in SPECIALS or kinds.get(token, USER_DEFINED) in (CONTROL, USER_DEFINED)
    ]
    metaspace = {"type": "Metaspace", "replacement": "\u2581", "prepend_scheme": "never", "split": True}
    decoder = {**metaspace, "prepend_scheme": "always" if spec.add_dummy_prefix else "never"}
    if spec.precompiled_charsmap:  # transformers' NLLB form (NllbTokenizer rebuilds it, whatever the file says)
        normalizers = [{"type": "Precompiled", "precompiled_charsmap": _charsmap(spec)}]
        if spec.remove_extra_whitespaces:
            normalizers.append({"type": "Replace", "pattern": {"Regex": " {2,}"}, "content": " "})
        pre_tokenizer = decoder
    else:  # SentencePiece's dummy prefix starts every text, one starting with a space too (Metaspace's does not)
        normalizers = [{"type": "Prepend", "prepend": "\u2581"}] if spec.add_dummy_prefix else []
        pre_tokenizer = metaspace
    byte_fallback = bool(proto.trainer_spec.byte_fallback)
    if byte_fallback:
        decoder = {"type": "Sequence", "decoders": [{"type": "ByteFallback"}, decoder]}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": {"type": "Sequence", "normalizers": normalizers} if normalizers else None,
        "pre_tokenizer": pre_tokenizer,
        "post_processor": _template(vocab, source_code),
        "decoder": decoder,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": "<unk>",
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": True,
            "byte_fallback": byte_fallback,
            "ignore_merges": False,
            "vocab": bpe_vocab,
            "merges": _merges(proto),
        },
    }


def _charsmap(spec: Any) -> str:
    import base64

    return base64.b64encode(spec.precompiled_charsmap).decode()


def _special_ids(vocab: Vocabulary) -> dict[str, int]:
    ids = {token: i for i, token in vocab.tokens.items()}
    return {field: ids[token] for token, field in SPECIALS.items()}


def hf_config(config: Any, vocab: Vocabulary) -> dict[str, Any]:
    """config.json of M2M100ForConditionalGeneration for a config of ours (check_exportable first)."""
    m, ids = config.model, _special_ids(vocab)
    start = ids["bos"] if vocab.order is not None else m.bos_id  # our bos is <s>; a converted model's its own
    return {
        "architectures": [m2m100.ARCHITECTURE],
        "model_type": m2m100.MODEL_TYPE,
        "vocab_size": m.vocab_size,
        "d_model": m.d_model,
        "encoder_layers": m.num_encoder_layers,
        "decoder_layers": m.num_decoder_layers,
        "encoder_attention_heads": m.num_heads,
        "decoder_attention_heads": m.num_heads,
        "encoder_ffn_dim": m.d_ff,
        "decoder_ffn_dim": m.d_ff,
        "activation_function": marian.EXPORT_ACTIVATIONS[m.activation],
        "dropout": m.dropout_rate,
        "attention_dropout": m.attention_dropout_rate,
        "activation_dropout": m.ffn_dropout_rate,
        "encoder_layerdrop": 0.0,
        "decoder_layerdrop": 0.0,
        "max_position_embeddings": m.max_len,
        "scale_embedding": True,
        "tie_word_embeddings": True,
        "is_encoder_decoder": True,
        "bos_token_id": ids["bos"],
        "pad_token_id": ids["pad"],
        "eos_token_id": ids["eos"],
        "decoder_start_token_id": start,
    }


def generation_config(config: Any, hf: dict[str, Any]) -> dict[str, Any]:
    """generation_config.json: marian.generation_config's search settings with the exported ids."""
    keys = ("decoder_start_token_id", "bos_token_id", "eos_token_id", "pad_token_id")
    return {
        **marian.generation_config(config),
        **{key: hf[key] for key in keys},
        "forced_eos_token_id": hf["eos_token_id"],
        "bad_words_ids": [[hf["pad_token_id"]]],
    }


def _nllb_tokenizer_config(config: Any, vocab: Vocabulary) -> dict[str, Any]:
    codes = sorted(vocab.codes, key=vocab.codes.get)
    source = "eng_Latn" if "eng_Latn" in vocab.codes else codes[0]
    return {
        "tokenizer_class": "NllbTokenizer",
        "backend": "tokenizers",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "cls_token": "<s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "mask_token": MASK if MASK in vocab.tokens.values() else None,
        "extra_special_tokens": codes,  # without them NllbTokenizer adds all 202 of NLLB-200's
        "legacy_behaviour": False,
        "src_lang": source,
        "tgt_lang": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config.model.max_len,
    }


def _m2m100_files(config: Any, vocab: Vocabulary) -> dict[str, bytes]:
    """A converted M2M-100 workdir's tokenizer as M2M100Tokenizer reads it: vocab.json up to the first code, the
    list its codes are, and the madeup words after them."""
    first = min(vocab.codes.values())
    names = [name for name, codes in languages.M2M100_CODES.items() if [f"__{c}__" for c in codes] == list(vocab.codes)]
    if not names or sorted(vocab.codes.values()) != list(range(first, first + len(vocab.codes))):
        raise ConfigError("cannot export to M2M-100: model.language_codes are not one of M2M-100's code lists in order")
    madeup = sum(1 for token in vocab.tokens.values() if MADEUP_WORD.fullmatch(token))
    pieces = {token: i for i, token in sorted(vocab.tokens.items()) if i < first}
    tokenizer_config = {
        "tokenizer_class": "M2M100Tokenizer",
        "language_codes": names[0],
        "num_madeup_words": madeup,
        "bos_token": "<s>",
        "eos_token": "</s>",
        "sep_token": "</s>",
        "unk_token": "<unk>",
        "pad_token": "<pad>",
        "src_lang": "en",
        "model_max_length": config.model.max_len,
    }
    return {
        m2m100_vocab.VOCAB: json.dumps(pieces, ensure_ascii=False, indent=0).encode(),
        TOKENIZER_CONFIG: json.dumps(tokenizer_config, indent=2).encode(),
    }


def tokenizer_files(config: Any, vocab: Vocabulary) -> dict[str, bytes]:
    """The exported tokenizer's files (name -> contents), the SentencePiece model aside."""
    if any(M2M100_CODE.fullmatch(code) for code in vocab.codes):
        return _m2m100_files(config, vocab)
    tokenizer_config = _nllb_tokenizer_config(config, vocab)
    source_code = None if config.model.lang_token == "target" else tokenizer_config["src_lang"]
    return {
        TOKENIZER_JSON: json.dumps(tokenizer_json(vocab, source_code), ensure_ascii=False, indent=2).encode(),
        TOKENIZER_CONFIG: json.dumps(tokenizer_config, indent=2).encode(),
    }


def export_workdir(
    workdir: str,
    output_dir: str | os.PathLike,
    *,
    config: Any = None,
    choice: CheckpointChoice = LATEST,
    force: bool = False,
) -> dict[str, Any]:
    """Exports the checkpoints evaluate.py would use (same flags, selection and averaging) whole or not at all;
    returns a report, with `epsilon_logit_difference` when model.norm_epsilon is not transformers' 1e-5 (the caller
    warns). Everything cheap (flags, output, whether the format can hold the config) is checked first."""
    choice = check_choice(choice)
    output_dir = Path(output_dir)
    folders.check_output(output_dir, force, SAFETENSORS, "an M2M-100 export")
    config, model, steps, tokenizer = folders.restore_checked(workdir, config, choice, check_exportable)
    m = config.model
    if config.data.tokenizer == "fairseq":
        vocab = converted_vocabulary(config, Path(workdir))
    else:
        vocab = own_vocabulary(config, tokenizer)
    files = tokenizer_files(config, vocab)
    hf = hf_config(config, vocab)
    report: dict[str, Any] = {
        "output": str(output_dir),
        "format": FORMAT,
        "workdir": str(workdir),
        "checkpoint_steps": steps,
        "languages": sorted(vocab.codes),
    }
    if m.norm_epsilon != m2m100.NORM_EPSILON:
        ids = [tokenizer.encode_source(s)[: m.max_len - 1] + [m.eos_id] for s in SAMPLE_SENTENCES]
        report["norm_epsilon"] = m.norm_epsilon
        report["epsilon_logit_difference"] = marian.epsilon_logit_difference(model, ids)
    tensors = marian.marian_tensors(model)
    del tensors["final_logits_bias"]  # marian_tensors' zero row: M2M-100 has none
    if vocab.order is not None:
        tensors["model.shared.weight"] = np.ascontiguousarray(tensors["model.shared.weight"][vocab.order])

    def fill(tmp: Path) -> None:
        from safetensors.numpy import save_file

        save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})  # transformers requires "pt"
        (tmp / CONFIG).write_text(json.dumps(hf, indent=2))
        (tmp / GENERATION).write_text(json.dumps(generation_config(config, hf), indent=2))
        shutil.copyfile(vocab.spm, tmp / FAIRSEQ_SPM)
        for name, contents in files.items():
            (tmp / name).write_bytes(contents)

    folders.write_into_place(output_dir, fill)
    return report
