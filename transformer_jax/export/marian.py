"""Export to Hugging Face Marian: a folder that MarianMTModel.from_pretrained and MarianTokenizer.from_pretrained load.

Axis letters: see transformer_jax/__init__.py.

The folder holds config.json, generation_config.json, model.safetensors (written with safetensors.numpy: no torch),
source.spm, target.spm, vocab.json (target_vocab.json with separate vocabularies) and tokenizer_config.json. The
parameters map through transformer_jax.convert.marian's one table; a model in the paper's interleaved positional
layout has the model axis of every weight permuted (exact: see that module). transformers fixes LayerNorm's
epsilon at 1e-5: another model.norm_epsilon exports with a warning that states the largest logit difference it
makes on a few sentences (`epsilon_logit_difference`). A workdir with our joint tokenizer (spm.model) exports it
as both source.spm and target.spm, with vocab.json listing its pieces with their ids.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax.numpy as jnp
import numpy as np
import sentencepiece as spm
from flax import nnx
from flax.traverse_util import flatten_dict

from transformer_jax.convert import folder, marian
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.command import check_folder_writable
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice
from transformer_jax.export import output
from transformer_jax.model.layers import LayerNorm

MARKER = folder.SAFETENSORS  # what makes a directory an earlier export that --force may replace
# The sentences the epsilon warning measures logits on: any text shows the difference, these are short and plain.
SAMPLE_SENTENCES = (
    "A man in a blue shirt is standing on a ladder.",
    "Two young children are playing in the sand.",
    "The weather was cold, so we stayed at home and read.",
)


def marian_tensors(model: Any) -> dict[str, np.ndarray]:
    """Marian's state dict (name -> float32 array) of a model of ours (check_exportable first)."""
    spec = model.spec
    flat = flatten_dict(nnx.to_pure_dict(nnx.state(model, nnx.Param)))
    perm = marian.permutation(spec.d_model) if spec.sinusoid_layout == "interleaved" else None
    tensors = {}
    for entry in marian.table(spec):
        if entry.ours in flat:
            tensors[entry.marian] = marian.to_marian(entry, np.asarray(flat[entry.ours], np.float32), perm)
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
            module.epsilon = marian.NORM_EPSILON
    largest = 0.0
    for ids in token_ids:
        src = jnp.asarray([list(ids)], jnp.int32)
        tgt = jnp.asarray([[model.spec.bos_id, *ids[:-1]]], jnp.int32)
        ours = model.decode(model.encode(src), tgt, src_tokens=src)
        theirs = fixed.decode(fixed.encode(src), tgt, src_tokens=src)
        largest = max(largest, float(jnp.max(jnp.abs(ours - theirs))))
    return largest


def _pieces(path: Path) -> list[str]:
    sp = spm.SentencePieceProcessor(model_file=str(path))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def tokenizer_files(config: Any, workdir: Path, tokenizer: Any) -> tuple[dict[str, Path], dict[str, bytes]]:
    """(files to copy: exported name -> source file, files to write: name -> bytes) of the workdir's tokenizer.

    A Marian workdir (data.tokenizer=marian) exports its four files as they are; our joint SentencePiece model is
    both source.spm and target.spm, with vocab.json mapping each piece to its id.
    """
    if config.data.tokenizer == folder.MARIAN_TOKENIZER:
        return {path.name: path for path in tokenizer_lib.tokenizer_files(config.data, workdir)}, {}
    pieces = _pieces(tokenizer.path)
    if len(pieces) != config.model.vocab_size:
        raise EvalError(
            f"tokenizer {tokenizer.path} has {len(pieces)} pieces but the model has model.vocab_size="
            f"{config.model.vocab_size} rows; export with the tokenizer the model was trained with"
        )
    vocab = json.dumps({piece: i for i, piece in enumerate(pieces)}, ensure_ascii=False, indent=2)
    copies = {folder.SOURCE_SPM: tokenizer.path, folder.TARGET_SPM: tokenizer.path}
    return copies, {folder.VOCAB: vocab.encode()}


def _special_pieces(config: Any, vocab_file: Path | bytes) -> dict[str, str]:
    text = vocab_file.decode() if isinstance(vocab_file, bytes) else vocab_file.read_text()
    by_id = {i: piece for piece, i in json.loads(text).items()}
    m = config.model
    return {"unk_token": by_id[m.unk_id], "eos_token": by_id[m.eos_id], "pad_token": by_id[m.pad_id]}


def to_marian(model: Any, config: Any, files: tuple[dict[str, Path], dict[str, bytes]], output_dir: Path) -> Path:
    """Writes the Marian folder of `model` (its config `config`, its tokenizer `files`) whole or not at all."""
    marian.check_exportable(config)
    copies, writes = files
    tensors = marian_tensors(model)
    target_vocab = writes.get(folder.VOCAB) or copies.get(folder.TARGET_VOCAB) or copies[folder.VOCAB]
    tokenizer_config = {
        "tokenizer_class": "MarianTokenizer",
        "source_lang": config.data.src_lang,
        "target_lang": config.data.tgt_lang,
        "separate_vocabs": folder.TARGET_VOCAB in copies,
        "model_max_length": config.model.max_len,
        **_special_pieces(config, target_vocab),
    }

    def fill(tmp: Path) -> None:
        from safetensors.numpy import save_file

        save_file(tensors, str(tmp / folder.SAFETENSORS), metadata={"format": "pt"})  # transformers requires "pt"
        (tmp / folder.CONFIG).write_text(json.dumps(marian.marian_config(config), indent=2))
        (tmp / folder.GENERATION).write_text(json.dumps(marian.generation_config(config), indent=2))
        (tmp / folder.TOKENIZER_CONFIG).write_text(json.dumps(tokenizer_config, indent=2))
        for name, source in copies.items():
            shutil.copyfile(source, tmp / name)
        for name, data in writes.items():
            (tmp / name).write_bytes(data)

    return output.write_into_place(output_dir, fill)


def export_workdir(
    workdir: str,
    output_dir: str | os.PathLike,
    *,
    config: Any = None,
    choice: CheckpointChoice = LATEST,
    force: bool = False,
) -> dict[str, Any]:
    """Exports the checkpoints evaluate.py would use (same flags, selection and averaging); returns a report,
    with `epsilon_logit_difference` when model.norm_epsilon is not Marian's 1e-5 (the caller warns).

    The flags, the output directory and whether Marian can represent the config are checked before any
    parameter is read.
    """
    choice = check_choice(choice)
    output_dir = Path(output_dir)
    output.check_output(output_dir, force, MARKER, "a Marian export")
    check_folder_writable(output_dir.parent, "--output")
    config, model, steps, tokenizer = output.restore_checked(workdir, config, choice, marian.check_exportable)
    files = tokenizer_files(config, Path(workdir), tokenizer)
    report: dict[str, Any] = {
        "output": str(output_dir),
        "format": "marian",
        "workdir": str(workdir),
        "checkpoint_steps": steps,
    }
    if config.model.norm_epsilon != marian.NORM_EPSILON:
        ids = [tokenizer.encode_source(s)[: config.model.max_len - 1] + [config.model.eos_id] for s in SAMPLE_SENTENCES]
        report["norm_epsilon"] = config.model.norm_epsilon
        report["epsilon_logit_difference"] = epsilon_logit_difference(model, ids)
    to_marian(model, config, files, output_dir)
    return report
