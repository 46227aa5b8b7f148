"""A Hugging Face Marian folder <-> a workdir of ours: read_folder + write_workdir import, export_workdir exports.

The folder is what `huggingface-cli download Helsinki-NLP/opus-mt-en-de` fetches and what MarianMTModel and
MarianTokenizer.from_pretrained load: config.json, model.safetensors (or pytorch_model.bin), generation_config.json,
source.spm, target.spm, vocab.json (target_vocab.json with separate vocabularies), tokenizer_config.json.
safetensors are read one tensor at a time and written without torch; a .bin is a pickle (it can run code), read
with torch only when the caller allows it. Our joint tokenizer (spm.model) exports as both source.spm and
target.spm, with vocab.json listing its pieces.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict

from transformer_jax import cli
from transformer_jax.config import schema
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice
from transformer_jax.interop import folders, marian
from transformer_jax.training import checkpoints

CONFIG, GENERATION, TOKENIZER_CONFIG = "config.json", "generation_config.json", "tokenizer_config.json"
SAFETENSORS, PICKLE = "model.safetensors", "pytorch_model.bin"  # the export's marker for --force: SAFETENSORS
SOURCE_SPM, TARGET_SPM = tokenizer_lib.MARIAN_SOURCE_SPM, tokenizer_lib.MARIAN_TARGET_SPM  # Marian's names, ours too
VOCAB, TARGET_VOCAB = tokenizer_lib.MARIAN_VOCAB, tokenizer_lib.MARIAN_TARGET_VOCAB
BASE_SIZE = "base"  # the size row a converted config starts from; every model key is then set from config.json
MARIAN_TOKENIZER = tokenizer_lib.MarianTokenizer.name  # data.tokenizer of a workdir holding the files above
LANGUAGE_KEYS = {"source_lang": "src_lang", "target_lang": "tgt_lang"}  # tokenizer_config.json -> config.data
# The sentences the epsilon difference is measured on: any text shows it, these are short and plain.
SAMPLE_SENTENCES = (
    "A man in a blue shirt is standing on a ladder.",
    "Two young children are playing in the sand.",
    "The weather was cold, so we stayed at home and read.",
)


@dataclasses.dataclass
class HfFolder:
    """A checked Hugging Face folder (Marian's, or M2M-100's: m2m100_folder.py): our config, its tensors and how its
    tokenizer goes into a workdir."""

    path: Path
    config: Any  # ml_collections.ConfigDict, validated
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]  # (name, array), one at a time
    write_tokenizer: Callable[[Path], None]  # writes the workdir's tokenizer files into the given directory
    params: Callable[[Any, Iterator[tuple[str, np.ndarray]], Path], dict] = marian.from_marian_tensors


# -- import ---------------------------------------------------------------------------------------------------------


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """A JSON object file of a Hugging Face folder ({} for a missing optional one); DataError naming it."""
    if not path.is_file():
        if required:
            raise DataError(f"{path} is missing; give a Hugging Face model folder (see docs/pretrained.md)")
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(value, dict):
        raise DataError(f"{path} is not a JSON object")
    return value


def _vocab(path: Path, rows: int, special: dict[str, tuple[int, str]]) -> dict[str, int]:
    """vocab.json (piece -> id), checked against the embedding's rows and `special`: piece -> (the id config.json
    gives it, that key)."""
    vocab = read_json(path)
    ids = list(vocab.values())
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise DataError(f"{path}: every value must be an integer id")
    if len(vocab) != rows or sorted(ids) != list(range(rows)):
        raise DataError(
            f"{path} maps {len(vocab)} pieces to ids {min(ids, default=0)}..{max(ids, default=0)} but the embedding "
            f"has {rows} rows (config.json); the vocabulary and the weights are of different models"
        )
    for piece, (expected, key) in special.items():
        if vocab.get(piece) != expected:
            raise DataError(f"{path} gives {piece} id {vocab.get(piece)} but config.json {key} is {expected}")
    if marian.UNK_PIECE not in vocab:
        raise DataError(f"{path} has no {marian.UNK_PIECE} piece (MarianTokenizer requires one)")
    return vocab


def tensor_reader(path: Path, allow_pickle: bool) -> Callable[[], Iterator[tuple[str, np.ndarray]]]:
    """A function yielding the folder's tensors as float32 numpy arrays, one at a time."""
    safetensors = path / SAFETENSORS
    if safetensors.is_file():
        try:
            from safetensors import safe_open

            with safe_open(str(safetensors), framework="np") as f:
                names = list(f.keys())
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise DataError(f"{safetensors} cannot be read: {e}") from None

        def read() -> Iterator[tuple[str, np.ndarray]]:
            # The file is mapped once per tensor: the pages a mapping has read count in the process's RSS until
            # it is closed, so one mapping for all tensors would hold a second copy of the weights.
            for name in names:
                with safe_open(str(safetensors), framework="np") as f:
                    tensor = f.get_tensor(name)
                yield name, tensor

        return read
    pickle = path / PICKLE
    if not pickle.is_file():
        raise DataError(f"{path} holds neither {SAFETENSORS} nor {PICKLE}; download the model's weights")
    if not allow_pickle:
        raise DataError(
            f"{pickle} is a pickle, which can run code when loaded: pass --allow_pickle if you trust it, or "
            f"download {SAFETENSORS}"
        )
    try:
        import torch
    except ImportError:
        raise DataError(
            f"{pickle} needs torch to be read (pip install torch==2.13.0), or download {SAFETENSORS}"
        ) from None

    def read_pickle() -> Iterator[tuple[str, np.ndarray]]:
        state = torch.load(str(pickle), map_location="cpu", weights_only=True)  # tensors only, no other objects
        for name in list(state):
            yield name, state.pop(name).float().numpy()

    return read_pickle


def _our_config(hf: dict, generation: dict, tokenizer_config: dict, unk_id: int) -> Any:
    """Our validated config of a Marian config.json, generation_config.json and tokenizer_config.json."""
    config = schema.base_config(BASE_SIZE)
    values = {**marian.model_keys(hf, unk_id), **marian.eval_keys(generation)}
    values["eval.average_last"] = 1  # the workdir holds one checkpoint
    values["data.tokenizer"] = MARIAN_TOKENIZER
    for theirs, ours in LANGUAGE_KEYS.items():
        if isinstance(tokenizer_config.get(theirs), str) and tokenizer_config[theirs].isidentifier():
            values[f"data.{ours}"] = tokenizer_config[theirs]
    for key, value in values.items():
        group, leaf = key.split(".")
        config[group][leaf] = value
    cli.validate(config)
    return config


def read_folder(path: str | os.PathLike, *, allow_pickle: bool = False) -> HfFolder:
    """Checks a Marian folder's files and config (DataError/ConfigError naming the file or key); reads no weights."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"{path} is not a directory; give a Hugging Face model folder")
    hf = read_json(path / CONFIG)
    generation = read_json(path / GENERATION, required=False)
    tokenizer_config = read_json(path / TOKENIZER_CONFIG, required=False)
    if hf.get("model_type") != marian.MODEL_TYPE:
        raise ConfigError(
            f"{path / CONFIG} key model_type={hf.get('model_type')!r}: not a Marian model (expected "
            f"{marian.MODEL_TYPE!r})"
        )
    shared = bool(hf.get("share_encoder_decoder_embeddings", True))
    separate = bool(tokenizer_config.get("separate_vocabs", False)) or not shared
    rows = hf.get("vocab_size")
    if not isinstance(rows, int):
        raise ConfigError(f"{path / CONFIG} key vocab_size={rows!r}: expected an integer")
    target_rows = rows if shared else int(hf.get("decoder_vocab_size") or rows)
    target_vocab = (TARGET_VOCAB,) if separate else ()
    for name in (SOURCE_SPM, TARGET_SPM, *target_vocab):  # vocab.json: read below
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing; a Marian folder holds the tokenizer files too")
    try:
        pad_id, eos_id = marian.one_id(hf, "pad_token_id"), marian.one_id(hf, "eos_token_id")
        special = {marian.PAD_PIECE: (pad_id, "pad_token_id"), marian.EOS_PIECE: (eos_id, "eos_token_id")}
        source_vocab = _vocab(path / VOCAB, rows, {} if separate else special)
        if separate:
            _vocab(path / TARGET_VOCAB, target_rows, special)
        config = _our_config(hf, generation, tokenizer_config, source_vocab[marian.UNK_PIECE])
    except ConfigError as e:
        raise ConfigError(f"{path / CONFIG}: {e}") from None
    files = [path / name for name in (SOURCE_SPM, TARGET_SPM, VOCAB, *target_vocab)]

    def write_tokenizer(directory: Path) -> None:
        for file in files:
            shutil.copyfile(file, directory / file.name)

    return HfFolder(path, config, tensor_reader(path, allow_pickle), write_tokenizer)


def check_workdir(workdir: str | os.PathLike) -> Path:
    """The workdir to write; DataError if it exists and is not an empty directory."""
    workdir = Path(workdir)
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise DataError(f"--workdir {workdir} exists and is not empty; give a new directory")
    return workdir


def write_workdir(folder: HfFolder, workdir: str | os.PathLike) -> dict[str, Any]:
    """Writes the workdir (config.json, the tokenizer files, a step-0 checkpoint) whole or not at all; returns a
    report. The checkpoint holds the model's parameters alone (TrainState field "model"), all that evaluation and
    train.init_from read, as jax arrays sharing the converted buffer (DLPack: no copy): Orbax's save of numpy arrays
    holds more temporaries, and a copy would hold the weights twice (benchmarks/convert_marian.py)."""
    workdir, config = check_workdir(workdir), folder.config
    params = folder.params(config, folder.tensors(), folder.path / SAFETENSORS)
    params = jax.tree.map(jax.dlpack.from_dlpack, params)

    def fill(tmp: Path) -> None:
        folder.write_tokenizer(tmp)
        (tmp / "config.json").write_text(config.to_json_best_effort(indent=2))
        ckpt = config.ckpt.copy_and_resolve_references()
        ckpt.async_save = False
        checkpoints.checkpoint_dir(tmp).mkdir()  # Orbax lists it before its first save
        saver = checkpoints.Checkpointer(tmp, ckpt)
        saver.save(0, nnx.State({"model": params}), None, config)
        saver.close()

    folders.write_into_place(workdir, fill)
    return {
        "workdir": str(workdir),
        "from": str(folder.path),
        "parameters": int(sum(x.size for x in flatten_dict(params).values())),
        "eval": {k: config.eval[k] for k in ("beam_size", "max_len", "alpha")},
    }


# -- export ---------------------------------------------------------------------------------------------------------


def tokenizer_files(config: Any, workdir: Path, tokenizer: Any) -> dict[str, Path | bytes]:
    """The exported tokenizer files: name -> the file to copy or the bytes to write. A Marian workdir's files as they
    are, or our joint model as both source.spm and target.spm, with vocab.json."""
    if config.data.tokenizer == MARIAN_TOKENIZER:
        return {path.name: path for path in tokenizer_lib.tokenizer_files(config.data, workdir)}
    pieces = folders.vocabulary(tokenizer, config.model.vocab_size)
    vocab = json.dumps({piece: i for i, piece in enumerate(pieces)}, ensure_ascii=False, indent=2)
    return {SOURCE_SPM: tokenizer.path, TARGET_SPM: tokenizer.path, VOCAB: vocab.encode()}


def export_workdir(
    workdir: str,
    output_dir: str | os.PathLike,
    *,
    config: Any = None,
    choice: CheckpointChoice = LATEST,
    force: bool = False,
) -> dict[str, Any]:
    """Exports the checkpoints evaluate.py would use (same flags, selection and averaging) whole or not at all;
    returns a report, with `epsilon_logit_difference` when model.norm_epsilon is not Marian's 1e-5 (the caller
    warns). Everything cheap (flags, output, whether Marian can represent the config) is checked first.
    """
    choice = check_choice(choice)
    output_dir = Path(output_dir)
    folders.check_output(output_dir, force, SAFETENSORS, "a Marian export")
    config, model, steps, tokenizer = folders.restore_checked(workdir, config, choice, marian.check_exportable)
    files = tokenizer_files(config, Path(workdir), tokenizer)
    report: dict[str, Any] = {
        "output": str(output_dir),
        "format": "marian",
        "workdir": str(workdir),
        "checkpoint_steps": steps,
    }
    m = config.model
    if m.norm_epsilon != marian.NORM_EPSILON:
        ids = [tokenizer.encode_source(s)[: m.max_len - 1] + [m.eos_id] for s in SAMPLE_SENTENCES]
        report["norm_epsilon"] = m.norm_epsilon
        report["epsilon_logit_difference"] = marian.epsilon_logit_difference(model, ids)
    tensors = marian.marian_tensors(model)
    target_vocab = files.get(TARGET_VOCAB) or files[VOCAB]
    text = target_vocab.decode() if isinstance(target_vocab, bytes) else target_vocab.read_text()
    piece = {i: piece for piece, i in json.loads(text).items()}
    tokenizer_config = {
        "tokenizer_class": "MarianTokenizer",
        **{theirs: config.data[ours] for theirs, ours in LANGUAGE_KEYS.items()},
        "separate_vocabs": TARGET_VOCAB in files,
        "model_max_length": m.max_len,
        "unk_token": piece[m.unk_id],
        "eos_token": piece[m.eos_id],
        "pad_token": piece[m.pad_id],
    }

    def fill(tmp: Path) -> None:
        from safetensors.numpy import save_file

        save_file(tensors, str(tmp / SAFETENSORS), metadata={"format": "pt"})  # transformers requires "pt"
        (tmp / CONFIG).write_text(json.dumps(marian.marian_config(config), indent=2))
        (tmp / GENERATION).write_text(json.dumps(marian.generation_config(config), indent=2))
        (tmp / TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2))
        for name, source in files.items():
            if isinstance(source, bytes):
                (tmp / name).write_bytes(source)
            else:
                shutil.copyfile(source, tmp / name)

    folders.write_into_place(output_dir, fill)
    return report
