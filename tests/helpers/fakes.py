"""Workdirs with known parameters (real checkpoints and a character tokenizer), and tokenizers whose ids the tests
control."""

from __future__ import annotations

import atexit
import io
import pathlib
import shutil
import tempfile

import jax
import numpy as np
import sentencepiece as spm
from flax import nnx

from configs import common
from transformer_jax.model import build_model
from transformer_jax.model.layers import SpecialIds
from transformer_jax.training import checkpoints
from transformer_jax.training.checkpoints import Checkpointer


def tiny_config(**model_overrides):
    """The tiny model (vocab 50) with the decoding settings of three_checkpoints."""
    config = common.base_config("tiny")
    config.model.vocab_size = 50
    config.model.update(model_overrides)
    config.eval.beam_size = 2
    config.eval.max_extra_len = 5  # with batch 4 and bucket 16: test_decoding's compiled search, when run together
    config.eval.batch_size = 4
    config.eval.average_last = 2
    return config


class JointTokenizer:
    """data/tokenizer.py's interface over a stand-in's `encode(text)` and `decode(ids)`, one vocabulary for both
    sides."""

    def encode_source(self, text: str) -> list[int]:
        return self.encode(text)

    encode_target = encode_source

    def encode_source_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    encode_target_batch = encode_source_batch

    def decode_target(self, ids) -> str:
        return self.decode(ids)


# The characters a workdir's tokenizer (write_workdir) gives ids 4..49, in this order, as decoding.CharTokenizer does.
ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?'-("


def write_workdir(workdir, config, params_of_step: dict, pieces: int | None = None) -> pathlib.Path:
    """A real workdir of `config` (vocabulary >= 50): a checkpoint at each step of `params_of_step` holding those model
    parameters (pure dicts), and an spm.model of `pieces` (default the vocabulary; fewer: a multilingual model's
    language ids follow them) that encodes ALPHABET's characters to ids 4..49 (others: unk)."""
    pieces = config.model.vocab_size if pieces is None else pieces
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    # All but the last character are user-defined pieces (ids in the order given); the last is learned from the
    # corpus, which SentencePiece needs; a space is the model's meta symbol U+2581.
    symbols = [c.replace(" ", "\u2581") for c in ALPHABET[:-1]]
    symbols += [f"<extra{i}>" for i in range(pieces - 50)]  # a larger vocabulary's other pieces
    model = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter([ALPHABET[-1] * 2]),
        model_writer=model,
        vocab_size=pieces,
        model_type="char",
        user_defined_symbols=symbols,
        pad_id=SpecialIds.DEFAULT.pad,
        eos_id=SpecialIds.DEFAULT.eos,
        bos_id=SpecialIds.DEFAULT.bos,
        unk_id=SpecialIds.DEFAULT.unk,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        add_dummy_prefix=False,
        hard_vocab_limit=False,
        minloglevel=2,
    )
    (workdir / "spm.model").write_bytes(model.getvalue())
    saver = Checkpointer(workdir, config.ckpt)
    for step, params in params_of_step.items():
        saver.save(step, nnx.State({"model": params}), {}, config)
    saver.close()
    return workdir


_BUILT: dict[str, pathlib.Path] = {}


def cached_workdir(workdir, key: str, build) -> pathlib.Path:
    """A copy at `workdir` of the workdir that build(folder) makes, built once per test session for `key`."""
    if key not in _BUILT:
        folder = pathlib.Path(tempfile.mkdtemp(prefix="workdir-"))
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        _BUILT[key] = build(folder)
    return pathlib.Path(shutil.copytree(_BUILT[key], workdir, dirs_exist_ok=True))


def base_params(config) -> dict:
    """Seeded random parameters (pure dict) of the config's model."""
    abstract = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
    rng = np.random.default_rng(0)
    return jax.tree.map(lambda s: (0.1 * rng.normal(size=s.shape)).astype(np.float32), shapes)


def three_checkpoints(workdir, config=None, steps=(100, 200, 300)) -> pathlib.Path:
    """A workdir of `config` (default tiny_config) with checkpoints at `steps`; step s holds base_params + s / 1000
    in every parameter."""

    def build(folder):
        base = base_params(tiny_config())
        params = {s: jax.tree.map(lambda x, s=s: x + np.float32(s / 1000), base) for s in steps}
        return write_workdir(folder, config or tiny_config(), params)

    return build(workdir) if config is not None else cached_workdir(workdir, f"three{steps}", build)


def reads(monkeypatch) -> list[int]:
    """The steps whose parameters are read from now on (training.checkpoints.load_model_params), in order."""
    read, steps = checkpoints.load_model_params, []

    def recording(workdir, step, abstract_state):
        steps.append(step)
        return read(workdir, step, abstract_state)

    monkeypatch.setattr(checkpoints, "load_model_params", recording)
    return steps


class WordTokenizer(JointTokenizer):
    """One id per space-separated word (ids from 4 up), so tests control lengths exactly."""

    ids = SpecialIds.DEFAULT  # the tiny configs' reserved ids

    def __init__(self):
        self.word_ids: dict[str, int] = {}
        self.words: dict[int, str] = {}

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self.word_ids:
                self.word_ids[word] = len(self.word_ids) + 4
                self.words[self.word_ids[word]] = word
            out.append(self.word_ids[word])
        return out

    def decode(self, ids) -> str:
        return " ".join(self.words[int(i)] for i in ids)
