"""An ensemble of independently trained models behind one model's decoding interface (not checkpoint averaging).

Axis letters: see transformer_jax/__init__.py.

`Ensemble` has the methods the search's model calls (model_calls.py) make: `encode`, `init_cache`, `decode`
with a cache, `grow_cache`, `reorder_cache`, `grow_source`, and a `spec` for the position limit; and the
teacher-forced call (`__call__`) that forced decoding (evaluation/scoring.py) makes. Each member keeps its own
cache (its cross- and self-attention layers, concatenated in member order inside one cache dict that shares the
per-row write index, the beam lineage and the source's segment ids), so the search, the refilling scheduler and
beam reordering treat the ensemble as one model. Each step returns the members' next-token log-probabilities
averaged and renormalised, log p(y) = 1/M sum_m log p_m(y) - log sum_y' exp(1/M sum_m log p_m(y')) (`mean_log_probs`,
the one rule for searching and for scoring). The members must share the vocabulary (one tokenizer).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.model.layers import SpecialIds

Array = jax.Array
Cache = dict[str, Any]
LAYER_KEYS = ("cross", "self")  # the cache's per-decoder-layer lists (model/transformer.py init_cache)


def mean_log_probs(logits: Sequence[Array]) -> Array:
    """The ensemble's log-probabilities [..., V] from its members' logits [..., V]: the mean of the members'
    log-probabilities, renormalised (module docstring)."""
    mean = jnp.mean(jnp.stack([jax.nn.log_softmax(x.astype(jnp.float32), -1) for x in logits]), axis=0)
    return jax.nn.log_softmax(mean, -1)


class Ensemble(nnx.Module):
    def __init__(self, members: Sequence[nnx.Module]):
        if len(members) < 2:
            raise ValueError(f"an ensemble needs at least 2 models, got {len(members)}")
        vocab = {m.spec.vocab_size for m in members}
        if len(vocab) > 1:
            raise ValueError(f"ensemble members differ in vocabulary size: {sorted(vocab)}")
        reserved = {SpecialIds.of(m.spec) for m in members}
        if len(reserved) > 1:
            raise ValueError(
                f"ensemble members differ in their reserved ids (model.*_id): {sorted(map(str, reserved))}"
            )
        self.members = nnx.List(members)

    @property
    def spec(self) -> Any:
        """The spec whose position limit is the tightest (a learned table's rows from its offset; sinusoidal: none)."""
        learned = [m.spec for m in self.members if m.spec.positional == "learned"]
        return min(learned, key=lambda s: s.max_len - s.position_offset) if learned else self.members[0].spec

    def _parts(self, cache: Cache) -> list[Cache]:
        """Each member's own cache (its layers of whichever per-layer lists the cache has: the search binding splits
        the cache into a fixed context and a per-step part), sharing the index and the source's segment ids."""
        parts, start = [], 0
        for n in (len(m.decoder_layers) for m in self.members):
            parts.append({**cache, **{k: cache[k][start : start + n] for k in LAYER_KEYS if k in cache}})
            start += n
        return parts

    @staticmethod
    def _join(parts: Sequence[Cache]) -> Cache:
        return {**parts[0], **{k: [c for p in parts for c in p[k]] for k in LAYER_KEYS if k in parts[0]}}

    def encode(self, src_tokens: Array, src_segment_ids: Array | None = None) -> list[Array]:
        return [m.encode(src_tokens, src_segment_ids) for m in self.members]

    def init_cache(self, memories: Sequence[Array], src_segment_ids: Array | None, max_len: int) -> Cache:
        return self._join(
            [m.init_cache(x, src_segment_ids, max_len) for m, x in zip(self.members, memories, strict=True)]
        )

    def decode(self, memory: None, tgt_tokens: Array, *, cache: Cache) -> tuple[Array, Cache]:
        """The ensemble's next-token log-probabilities [B, T, V] and the updated cache (decoding with a cache only)."""
        if memory is not None:
            raise ValueError("an Ensemble decodes with a cache only (init_cache)")
        outs = [m.decode(None, tgt_tokens, cache=c) for m, c in zip(self.members, self._parts(cache), strict=True)]
        return mean_log_probs([o[0] for o in outs]), self._join([o[1] for o in outs])

    def __call__(self, src_tokens: Array, tgt_in: Array, **batch: Array | None) -> Array:
        """The ensemble's teacher-forced log-probabilities [B, T, V] for a (possibly packed) batch: each member's
        teacher-forced call (model/transformer.py's, with the same keyword arguments) combined by mean_log_probs."""
        return mean_log_probs([m(src_tokens, tgt_in, **batch) for m in self.members])

    def grow_cache(self, cache: Cache, max_len: int) -> Cache:
        parts = self._parts(cache)
        return self._join([m.grow_cache(c, max_len) for m, c in zip(self.members, parts, strict=True)])

    def reorder_cache(self, cache: Cache, rows_R: Array) -> Cache:
        """The members' shared index and beam lineage follow the beams (model/transformer.py reorder_cache)."""
        return self.members[0].reorder_cache(cache, rows_R)

    def grow_source(self, cache: Cache, src_len: int) -> Cache:
        parts = self._parts(cache)
        return self._join([m.grow_source(c, src_len) for m, c in zip(self.members, parts, strict=True)])
