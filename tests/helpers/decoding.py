"""Stub decode steps and brute-force references shared by the decoding tests.

Stub decode steps follow the `decode_step(tokens, cache) -> (logits, cache)` interface. The hashing stub makes the
next-token distribution depend on the whole prefix (through a per-row hash carried in the cache), so a beam whose
cache row is not reordered with it gets the wrong distribution and the brute-force comparison fails.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from tests.helpers.model import random_tokens, tiny_model
from transformer_jax.tokens import BOS_ID, EOS_ID, PAD_ID

PAD, EOS, BOS = PAD_ID, EOS_ID, BOS_ID
VOCAB = 6  # 0 pad, 1 eos, 2 bos, 3 unk (never produced by the stubs), 4 and 5 "words"
WORDS = (EOS, 4, 5)
HASH_MOD = 101


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def hash_table(seed: int) -> np.ndarray:
    """[HASH_MOD, VOCAB] logits: only EOS and the two words are possible."""
    logits = np.random.default_rng(seed).normal(size=(HASH_MOD, VOCAB)) * 1.5
    logits[:, [PAD, BOS, 3]] = -np.inf
    return logits.astype(np.float32)


def next_hash(h, token):
    return (h * 31 + token + 1) % HASH_MOD


def hash_stub(table: np.ndarray):
    """decode_step whose logits are table[hash(source seed, every token fed so far)]."""
    table = jnp.asarray(table)

    def decode_step(tokens_R1, cache):
        h = next_hash(cache["h"], tokens_R1[:, 0])
        return table[h][:, None, :], {"h": h, "calls": cache["calls"] + 1}

    return decode_step


def brute_force(
    table: np.ndarray, seed: int, max_len: int, alpha: float, penalty: str = "gnmt"
) -> list[tuple[float, tuple[int, ...]]]:
    """(score, tokens) of every possible output, best first: EOS-ended up to max_len, or max_len words."""
    out = []

    def expand(h: int, last: int, prefix: tuple[int, ...], log_prob: float) -> None:
        h = next_hash(h, last)
        log_probs = log_softmax(table[h].astype(np.float64))
        for token in WORDS:
            seq, lp = prefix + (token,), log_prob + log_probs[token]
            if token == EOS or len(seq) == max_len:
                out.append((lp / reference_lp(len(seq), alpha, penalty), seq))
            else:
                expand(h, token, seq, lp)

    expand(seed, BOS, (), 0.0)
    return sorted(out, key=lambda x: -x[0])


def reference_lp(length: int, alpha: float, penalty: str) -> float:
    """The length penalty by its formula (gnmt: Wu et al. 2016; average: |Y| ** alpha; none: 1)."""
    return {"gnmt": ((5 + length) / 6) ** alpha, "average": length**alpha, "none": 1.0}[penalty]


@functools.lru_cache(maxsize=1)
def shared_model():
    return tiny_model(seed=1)


def sources_BS(batch: int = 2, length: int = 7):
    """Sources of different lengths (length - 2 and length tokens, alternating), PAD-padded, EOS-terminated."""
    src = np.array(random_tokens(3, (batch, length)))
    src[:, -1] = EOS
    src[::2, length - 3], src[::2, length - 2 :] = EOS, PAD
    return jnp.asarray(src)


ALPHABET = "abcdefghijklmnopqrstuvwxyz0123456789 .,;:!?'-("  # ids 4..49, the tiny model's vocabulary of 50


class CharTokenizer:
    """One id per character, invertible on ALPHABET (ids 4..49); other characters map to ids by their code, and
    the reserved ids 0..3 decode to nothing."""

    def encode(self, text: str) -> list[int]:
        return [4 + (ALPHABET.index(c) if c in ALPHABET else ord(c) % 46) for c in text]

    def encode_batch(self, texts, num_threads: int = 1) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids) -> str:
        assert EOS not in ids and PAD not in ids
        return "".join(ALPHABET[int(i) - 4] for i in ids if int(i) >= 4)


def tiny_eval_config():
    """The tiny config with vocab 50 and small decoding settings (beam 2, batch 4), one checkpoint to average."""
    from configs import common

    config = common.base_config("tiny")
    config.model.vocab_size = 50
    config.eval.update(beam_size=2, max_extra_len=5, batch_size=4, average_last=1)
    return config


class OneCheckpoint:
    """An evaluation Restorer (evaluation/restore.py) with one checkpoint: a freshly initialised tiny model."""

    def __init__(self, seed: int = 1):
        from flax import nnx

        from transformer_jax.model import build_model

        self.config = tiny_eval_config()
        model = build_model(self.config, rngs=nnx.Rngs(seed))
        self.params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        self.loaded = 0  # how many times the parameters were read

    def list_steps(self, workdir):
        return [100]

    def load_config(self, workdir):
        return self.config

    def config_differences(self, saved, current):
        return []

    def load_params(self, workdir, steps, abstract_params):
        for _ in steps:
            self.loaded += 1
            yield self.params

    def tokenizer(self, config, workdir):
        return CharTokenizer()
