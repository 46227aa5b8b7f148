"""Stub decode steps and brute-force references shared by the decoding tests.

Stub decode steps follow the `decode_step(tokens, cache) -> (logits, cache)` interface. The hashing stub makes the
next-token distribution depend on the whole prefix (through a per-row hash carried in the cache), so a beam whose
cache row is not reordered with it gets the wrong distribution and the brute-force comparison fails.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
import numpy as np

from tests.helpers.fakes import ALPHABET, JointTokenizer, cached_workdir, write_workdir
from tests.helpers.model import random_tokens, tiny_model
from transformer_jax.model.layers import SpecialIds

IDS = SpecialIds.DEFAULT  # the stubs' and the tiny models' reserved ids
PAD, EOS, BOS = IDS.pad, IDS.eos, IDS.bos
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


def set_aside_reference(
    table: np.ndarray,
    seed: int,
    max_len: int,
    width: int,
    n: int,
    alpha: float,
    penalty: str,
    prefix: tuple[int, ...] = (),
) -> list[tuple[float, tuple[int, ...]]]:
    """(score, tokens) of the n best hypotheses of CTranslate2's beam search (decoding.cc, BeamSearch, patience 1),
    written as its loop is, one sentence in plain Python: the 2 W best extensions by log P; each of the first W that
    ends (EOS, or the limit) is registered and its place taken by the next secondary candidate that is not EOS; done
    at the limit, with W registered, or (no normalisation) once the first candidate of some step ended and n are
    registered. Candidates of log P -inf are left out (decoding/state.py SetAsideState's one departure). With a target
    prefix, the search starts from it as its one beam (its tokens' log-probabilities counted), unless the limit
    cuts it first."""
    registered, top_ended = [], False
    h, last, log_p = seed, BOS, 0.0
    for step, token in enumerate(prefix):
        h = next_hash(h, last)
        log_p, last = log_p + log_softmax(table[h].astype(np.float64))[token], token
        if step + 1 == max_len:
            return [(log_p / reference_lp(step + 1, alpha, penalty), prefix[: step + 1])]
    beams = [(h, last, prefix, log_p)]  # (hash, last token, tokens, log P); the first step has one beam
    early = penalty == "none" or alpha == 0
    for step in range(len(prefix), max_len):
        candidates = []
        for b, (h, last, _, log_p) in enumerate(beams):
            h = next_hash(h, last)
            log_probs = log_softmax(table[h].astype(np.float64))
            candidates += [(log_p + log_probs[t], b, t, h) for t in range(VOCAB) if log_probs[t] > -np.inf]
        candidates.sort(key=lambda c: (-c[0], c[1], c[2]))  # ties: the lower beam, then the lower token
        candidates = candidates[: 2 * width]
        last_step = step + 1 == max_len
        secondary, kept = width, []
        for k in range(min(width, len(candidates))):
            log_p, b, t, h = candidates[k]
            chosen = candidates[k]
            if t == EOS or last_step:
                top_ended |= k == 0
                seq = beams[b][2] + (t,)
                registered.append((log_p / reference_lp(len(seq), alpha, penalty), seq))
                chosen = None
                while secondary < len(candidates):
                    secondary += 1
                    if candidates[secondary - 1][2] != EOS:
                        chosen = candidates[secondary - 1]
                        break
            if chosen is not None:
                log_p, b, t, h = chosen
                kept.append((h, t, beams[b][2] + (t,), log_p))
        if last_step or (top_ended and len(registered) >= n if early else len(registered) >= width):
            break
        beams = kept
    return sorted(registered, key=lambda x: -x[0])[:n]


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


class CharTokenizer(JointTokenizer):
    """One id per character, invertible on ALPHABET (ids 4..49); other characters map to ids by their code, and
    the reserved ids 0..3 decode to nothing."""

    ids = IDS

    def encode(self, text: str) -> list[int]:
        return [4 + (ALPHABET.index(c) if c in ALPHABET else ord(c) % 46) for c in text]

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


def one_checkpoint(workdir, seed: int = 1, config=None):
    """A workdir of tiny_eval_config (or `config`) with one checkpoint, at step 100: a freshly initialised model
    (nnx.Rngs(seed)); its tokenizer encodes as CharTokenizer."""
    from flax import nnx

    from transformer_jax.model import build_model

    def build(folder):
        cfg = config or tiny_eval_config()
        params = nnx.to_pure_dict(nnx.state(build_model(cfg, rngs=nnx.Rngs(seed)), nnx.Param))
        return write_workdir(folder, cfg, {100: params})

    key = f"one{seed}" if config is None else f"one{seed}-{config.to_json_best_effort(sort_keys=True)}"
    return cached_workdir(workdir, key, build)
