"""A Hugging Face M2M-100 or dense NLLB-200 folder -> a workdir of ours (`read_folder`, then
marian_folder.write_workdir, which every family shares).

The folder is what `huggingface-cli download facebook/nllb-200-distilled-600M` (or facebook/m2m100_418M) fetches:
config.json (model_type m2m_100), model.safetensors (or pytorch_model.bin), generation_config.json,
sentencepiece.bpe.model, and tokenizer.json (NLLB-200) or vocab.json (M2M-100) with tokenizer_config.json. The
workdir gets our config (data.tokenizer=fairseq, the code table model.language_codes), the SentencePiece model and
a vocab.json of every id (m2m100_vocab.py), and a step-0 checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.interop import m2m100, m2m100_vocab, marian
from transformer_jax.interop.marian_folder import (
    BASE_SIZE,
    CONFIG,
    GENERATION,
    TOKENIZER_CONFIG,
    HfFolder,
    read_json,
    tensor_reader,
)

FAIRSEQ_TOKENIZER = "fairseq"  # data.tokenizer of a converted M2M-100 / NLLB-200 workdir


def _our_config(hf: dict, generation: dict, vocab: m2m100_vocab.Vocabulary) -> Any:
    """Our validated config of an M2M-100 / NLLB-200 config.json, generation_config.json and vocabulary."""
    config = schema.base_config(BASE_SIZE)
    values = {**m2m100.model_keys(hf, vocab.pieces["<unk>"]), **marian.eval_keys(generation)}
    values["model.language_codes"] = tuple(sorted(vocab.codes.items(), key=lambda code: code[1]))
    values["eval.average_last"] = 1  # the workdir holds one checkpoint
    values["data.tokenizer"] = FAIRSEQ_TOKENIZER
    for key, value in values.items():
        group, leaf = key.split(".")
        config[group][leaf] = value
    cli.validate(config)
    return config


def _check_vocabulary(path: Path, hf: dict, vocab: m2m100_vocab.Vocabulary) -> None:
    """DataError unless the vocabulary fits the embedding, has codes and puts them first (read_vocabulary has
    checked the special ids against config.json)."""
    rows = hf["vocab_size"]
    largest = max([*vocab.pieces.values(), *vocab.codes.values()])
    if largest >= rows:
        raise DataError(
            f"{path}: the tokenizer has id {largest} but config.json vocab_size is {rows}; the tokenizer and the "
            "weights are of different models"
        )
    if vocab.legacy_behaviour:
        raise DataError(
            f"{path / TOKENIZER_CONFIG}: legacy_behaviour=true puts the source language's code after </s>; only "
            "NLLB's default layout ([code] X </s>) is supported: set it to false if the model was trained so"
        )
    if not vocab.codes:
        raise DataError(f"{path}: the tokenizer has no language codes; not a multilingual M2M-100 / NLLB-200 model")


def read_folder(path: str | os.PathLike, *, allow_pickle: bool = False) -> HfFolder:
    """Checks an M2M-100 / NLLB-200 folder's files and config (DataError/ConfigError naming the file or key); reads
    no weights."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path} is not a directory; give a Hugging Face model folder")
    hf = read_json(path / CONFIG)
    if hf.get("model_type") != m2m100.MODEL_TYPE:
        raise ConfigError(
            f"{path / CONFIG} key model_type={hf.get('model_type')!r}: not an M2M-100 / NLLB-200 model (expected "
            f"{m2m100.MODEL_TYPE!r})"
        )
    generation = read_json(path / GENERATION, required=False)
    vocab = m2m100_vocab.read_vocabulary(path)
    try:
        m2m100.model_keys(hf, 0)  # the keys first: _check_vocabulary reads vocab_size and the special ids
        _check_vocabulary(path, hf, vocab)
        config = _our_config(hf, generation, vocab)
    except ConfigError as e:
        raise ConfigError(f"{path / CONFIG}: {e}") from None

    def write_tokenizer(directory: Path) -> None:
        m2m100_vocab.write_vocabulary(vocab, directory)

    return HfFolder(path, config, tensor_reader(path, allow_pickle), write_tokenizer, m2m100.from_tensors)
