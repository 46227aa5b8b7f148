"""Stand-ins for the slow or real parts: a checkpoint reader serving known parameters, and tokenizers whose ids the
tests control."""

from __future__ import annotations

import jax
import numpy as np
from flax import nnx

from configs import common
from transformer_jax.model import build_model
from transformer_jax.model.spec import SpecialIds


def tiny_config(**model_overrides):
    """The tiny model (vocab 50) with the decoding settings FakeRestorer's tests use."""
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


class CharTokenizer(JointTokenizer):
    """Characters <-> ids 4..49 (vocab 50 of the tiny model), enough to drive translate()."""

    ids = SpecialIds.DEFAULT  # the tiny configs' reserved ids

    def encode(self, text: str) -> list[int]:
        return [4 + ord(c) % 46 for c in text]

    def decode(self, ids) -> str:
        return "".join(chr(ord("a") + (int(i) - 4) % 26) for i in ids)


class FakeRestorer:
    """Checkpoints at `steps`; step s holds base + s / 1000 in every parameter (evaluation.restore.Restorer's
    methods, without reading a checkpoint)."""

    def __init__(self, steps=(100, 200, 300)):
        self.steps, self.config, self.loaded = list(steps), tiny_config(), []
        abstract = nnx.eval_shape(lambda: build_model(self.config, rngs=nnx.Rngs(0)))
        shapes = nnx.to_pure_dict(nnx.state(abstract, nnx.Param))
        rng = np.random.default_rng(0)
        self.base = jax.tree.map(lambda s: (0.1 * rng.normal(size=s.shape)).astype(np.float32), shapes)

    def list_steps(self, workdir):
        return self.steps

    def load_config(self, workdir):
        return self.config

    def config_differences(self, saved, current):
        a, b = saved.model.to_dict(), current.model.to_dict()
        return [f"model.{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a) if a.get(k) != b.get(k)]

    def load_params(self, workdir, steps, abstract_params):
        for step in steps:
            self.loaded.append(step)
            yield jax.tree.map(lambda x, step=step: x + np.float32(step / 1000), self.base)

    def tokenizer(self, config, workdir):
        return CharTokenizer()


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
