"""A local Hugging Face Marian folder -> a workdir of ours: config, tokenizer files and a step-0 checkpoint.

    read_folder(DIR) -> MarianFolder      every file checked, nothing written
    write_workdir(folder, W)              W appears whole or not at all

The folder is what `huggingface-cli download Helsinki-NLP/opus-mt-en-de` fetches: config.json, model.safetensors
(or pytorch_model.bin), generation_config.json, source.spm, target.spm, vocab.json (target_vocab.json with
separate vocabularies), tokenizer_config.json. safetensors are read with safetensors.numpy, one tensor at a time;
a .bin is a pickle (it can run code), read with torch only when the caller allows it.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict

from transformer_jax.config import checks, schema
from transformer_jax.convert import marian
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model import TransformerSpec, build_model, model_rngs
from transformer_jax.training import checkpoints

CONFIG, GENERATION, TOKENIZER_CONFIG = "config.json", "generation_config.json", "tokenizer_config.json"
SAFETENSORS, PICKLE = "model.safetensors", "pytorch_model.bin"
_ALIGN_BYTES = 64  # the alignment at which jax's CPU client aliases a host buffer instead of copying it
SOURCE_SPM, TARGET_SPM = tokenizer_lib.MARIAN_SOURCE_SPM, tokenizer_lib.MARIAN_TARGET_SPM  # Marian's names, ours too
VOCAB, TARGET_VOCAB = tokenizer_lib.MARIAN_VOCAB, tokenizer_lib.MARIAN_TARGET_VOCAB
BASE_SIZE = "base"  # the size row a converted config starts from; every model key is then set from config.json
MARIAN_TOKENIZER = tokenizer_lib.MarianTokenizer.name  # data.tokenizer of a workdir holding the files above


@dataclasses.dataclass
class MarianFolder:
    """A checked Marian folder: our config and where its tensors and tokenizer files are."""

    path: Path
    config: Any  # ml_collections.ConfigDict, validated
    tensors: Callable[[], Iterator[tuple[str, np.ndarray]]]  # (name, array), one at a time
    tokenizer_files: dict[str, Path]  # workdir file name -> file in the folder


def _json(path: Path, required: bool = True) -> dict[str, Any]:
    if not path.is_file():
        if required:
            raise DataError(f"{path} is missing; give a Hugging Face Marian folder (see docs/pretrained.md)")
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
    vocab = _json(path)
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


def _tensor_reader(path: Path, allow_pickle: bool) -> Callable[[], Iterator[tuple[str, np.ndarray]]]:
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
    config = schema.base_config(BASE_SIZE)
    values = {**marian.model_keys(hf, unk_id), **marian.eval_keys(generation)}
    values["eval.average_last"] = 1  # the workdir holds one checkpoint
    values["data.tokenizer"] = MARIAN_TOKENIZER
    for ours, theirs in (("data.src_lang", "source_lang"), ("data.tgt_lang", "target_lang")):
        if isinstance(tokenizer_config.get(theirs), str) and tokenizer_config[theirs].isidentifier():
            values[ours] = tokenizer_config[theirs]
    for key, value in values.items():
        group, leaf = key.split(".")
        config[group][leaf] = value
    checks.validate(config)
    return config


def read_folder(path: str | os.PathLike, *, allow_pickle: bool = False) -> MarianFolder:
    """Checks a Marian folder's files and config (DataError/ConfigError naming the file or key); reads no weights."""
    path = Path(path)
    if not path.is_dir():
        raise DataError(f"--from_marian {path} is not a directory")
    hf = _json(path / CONFIG)
    generation = _json(path / GENERATION, required=False)
    tokenizer_config = _json(path / TOKENIZER_CONFIG, required=False)
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
    for name in (SOURCE_SPM, TARGET_SPM) + ((TARGET_VOCAB,) if separate else ()):
        if not (path / name).is_file():
            raise DataError(f"{path / name} is missing; a Marian folder holds the tokenizer files too")
    try:
        pad_id, eos_id = marian.one_id(hf, "pad_token_id"), marian.one_id(hf, "eos_token_id")
    except ConfigError as e:
        raise ConfigError(f"{path / CONFIG}: {e}") from None
    special = {marian.PAD_PIECE: (pad_id, "pad_token_id"), marian.EOS_PIECE: (eos_id, "eos_token_id")}
    source_vocab = _vocab(path / VOCAB, rows, {} if separate else special)
    if separate:
        _vocab(path / TARGET_VOCAB, target_rows, special)
    try:
        config = _our_config(hf, generation, tokenizer_config, source_vocab[marian.UNK_PIECE])
    except ConfigError as e:
        raise ConfigError(f"{path / CONFIG}: {e}") from None
    files = {name: path / name for name in (SOURCE_SPM, TARGET_SPM, VOCAB)}
    if separate:
        files[TARGET_VOCAB] = path / TARGET_VOCAB
    return MarianFolder(path, config, _tensor_reader(path, allow_pickle), files)


def convert_params(folder: MarianFolder) -> dict:
    """Our model parameters (a pure dict of float32 numpy arrays) from the folder's tensors, read and converted one
    at a time; ConfigError naming a tensor that is missing, unexpected or of the wrong shape.

    Every parameter is a view of one buffer allocated up front: converted arrays allocated one by one between the
    reader's temporaries would leave the freed temporaries as holes the allocator keeps (benchmarks/convert_marian.py
    measured half the weights again).
    """
    spec = TransformerSpec.from_config(folder.config)
    model = nnx.eval_shape(lambda: build_model(folder.config, rngs=model_rngs(0)))  # shapes only
    shapes = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    entries = {entry.marian: entry for entry in marian.table(spec)}
    tied = marian.aliases(spec)
    if set(shapes) != {entry.ours for entry in entries.values()}:  # the table and the model disagree: a bug
        raise AssertionError(f"mapping table and model differ: {set(shapes) ^ {e.ours for e in entries.values()}}")
    # Each view starts on a 64-byte boundary: jax takes such a buffer over without a copy (jax.dlpack.from_dlpack
    # in write_workdir); a view at any other address it copies.
    align = _ALIGN_BYTES // 4
    sizes = {path: -(-int(np.prod(x.shape)) // align) * align for path, x in shapes.items()}
    raw = np.empty(sum(sizes.values()) + align, np.float32)
    buffer = raw[(-raw.ctypes.data % _ALIGN_BYTES) // 4 :]
    views, offset = {}, 0
    for path, x in sorted(shapes.items(), key=lambda item: str(item[0])):
        size = int(np.prod(x.shape))
        views[path], offset = buffer[offset : offset + size].reshape(x.shape), offset + sizes[path]
    params: dict[tuple, np.ndarray] = {}
    copies: dict[str, np.ndarray] = {}
    where = folder.path / SAFETENSORS

    def put(entry: marian.Entry, array: np.ndarray) -> None:
        np.copyto(views[entry.ours], marian.from_marian(entry, array, shapes[entry.ours].shape, copy=False))
        params[entry.ours] = views[entry.ours]

    for name, array in folder.tensors():
        if name in entries:
            put(entries[name], array)
        elif name in tied:
            copies[name] = array
        elif name in marian.POSITION_KEYS:
            expected = marian.marian_positions(array.shape[0], spec.d_model)
            if array.shape != expected.shape or not np.allclose(array, expected, atol=1e-5):
                raise ConfigError(
                    f"{where}: tensor {name} is not Marian's sinusoidal table (learned positions?); it cannot be "
                    "converted"
                )
        else:
            raise ConfigError(f"{where}: unexpected tensor {name}; not a MarianMTModel of this config.json")
        del array
    for name, original in tied.items():
        if original in entries and entries[original].ours not in params and name in copies:
            put(entries[original], copies.pop(name))  # only the tied copy was saved
    for name, copy in copies.items():
        entry = entries[tied[name]]
        if not np.array_equal(marian.from_marian(entry, copy, shapes[entry.ours].shape), params[entry.ours]):
            raise ConfigError(
                f"{where}: tensor {name} differs from {tied[name]} but config.json ties them; the weights are not "
                "those of this config"
            )
    bias = ("final_logits_bias_V",)
    if bias not in params:  # transformers leaves it out when it is zero (_keys_to_ignore_on_load_missing)
        params[bias] = views[bias]
        params[bias][...] = 0.0
    missing = [entry.marian for entry in entries.values() if entry.ours not in params]
    if missing:
        raise ConfigError(f"{where}: tensor {missing[0]} is missing ({len(missing)} missing in all)")
    return unflatten_dict(params)


def model_state(params: dict) -> nnx.State:
    """The checkpoint's state: the model's parameters alone (TrainState field "model"), all that evaluation and
    train.init_from read (checkpoints.load_model_params). The optimizer's moments would be twice the weights again,
    in memory and on disk; the dropout streams are the config's (evaluation.restore.abstract_model)."""
    return nnx.State({"model": params})


def check_workdir(workdir: str | os.PathLike) -> Path:
    """The workdir to write; DataError if it exists and is not an empty directory."""
    workdir = Path(workdir)
    if workdir.exists() and (not workdir.is_dir() or any(workdir.iterdir())):
        raise DataError(f"--workdir {workdir} exists and is not empty; give a new directory")
    return workdir


def write_workdir(folder: MarianFolder, workdir: str | os.PathLike) -> dict[str, Any]:
    """Writes the workdir (config.json, the tokenizer files, the step-0 checkpoint of the model) under a temporary
    sibling name and renames it into place; returns a report."""
    workdir = check_workdir(workdir)
    workdir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{workdir.name}.", suffix=".tmp", dir=workdir.parent))
    try:
        # As jax arrays sharing the numpy buffer (DLPack: no copy): Orbax's save of numpy arrays holds more
        # temporaries, and a copy would hold the weights twice (benchmarks/convert_marian.py).
        params = jax.tree.map(jax.dlpack.from_dlpack, convert_params(folder))
        for name, source in folder.tokenizer_files.items():
            shutil.copyfile(source, tmp / name)
        config = folder.config
        (tmp / "config.json").write_text(config.to_json_best_effort(indent=2))
        ckpt = config.ckpt.copy_and_resolve_references()
        ckpt.async_save = False
        checkpoints.checkpoint_dir(tmp).mkdir()  # Orbax lists it before its first save
        saver = checkpoints.Checkpointer(tmp, ckpt)
        saver.save(0, model_state(params), None, config)
        saver.close()
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's 0700
        if workdir.exists():
            workdir.rmdir()  # empty (check_workdir)
        os.replace(tmp, workdir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return {
        "workdir": str(workdir),
        "from_marian": str(folder.path),
        "parameters": int(sum(x.size for x in flatten_dict(params).values())),
        "eval": {k: config.eval[k] for k in ("beam_size", "max_len", "alpha")},
    }
