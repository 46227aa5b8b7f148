"""Several tokenized corpora as one example id space, and their weighted, seeded, endless mix.

`MixedExamples` puts corpus c's examples at global ids first[c] .. first[c + 1] - 1 without copying them (each
part may be a memory-mapped store): the planners see the concatenated lengths, and `gather` copies just one
batch's examples into a compact `batching.Examples` that `batching.assemble` turns into the batch.

`Mix` is the stream: window w of the training stream (`pipeline.WindowBatchIterator`) draws, for each of its
positions, the corpus of the next pair with probability weight / sum of weights (one vectorised
`Generator.choice` seeded by (seed, w)), and takes each corpus's next pairs from that corpus's own endless
stream, reshuffled every time it runs out by a permutation seeded by (seed, corpus name, epoch). The pairs each
corpus has given before the window (`consumed`) are all the state a restart needs besides the window number.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from transformer_jax.data import batching

MIX_SEED = 0x6D6978  # separates the corpus draws' seed sequence from the planners' (seed, window)


class MixedExamples:
    """The examples of several corpora (`parts`, named by `names`, drawn with `weights`) under one id space."""

    def __init__(self, parts: Sequence[batching.Examples], names: Sequence[str], weights: Sequence[float]):
        self.parts, self.names = list(parts), list(names)
        self.probabilities = np.asarray(weights, np.float64) / np.sum(weights)
        self.first = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        self.src_lens = np.concatenate([p.src_lens for p in self.parts])
        self.tgt_lens = np.concatenate([p.tgt_lens for p in self.parts])

    def __len__(self) -> int:
        return int(self.first[-1])

    def corpus_of(self, ids: np.ndarray) -> np.ndarray:
        """The corpus index of each global example id."""
        return np.searchsorted(self.first, ids, side="right") - 1

    def gather(self, plan: batching.Plan) -> tuple[batching.Examples, batching.Plan, np.ndarray]:
        """(the plan's examples copied into compact Examples, the plan renumbered to them, real tokens per corpus)."""
        corpus = self.corpus_of(plan.items)
        order = np.argsort(corpus, kind="stable")
        sides: dict[str, list[np.ndarray]] = {"src": [], "src_lens": [], "tgt": [], "tgt_lens": []}
        for c in np.unique(corpus).tolist():
            local = plan.items[order][corpus[order] == c] - self.first[c]
            part = self.parts[c]
            for side, flat, starts in (("src", part.src, part.src_starts), ("tgt", part.tgt, part.tgt_starts)):
                tokens, lens = _take(flat, starts, local)
                sides[side].append(tokens)
                sides[f"{side}_lens"].append(lens)
        renumbered = np.empty(len(order), np.int64)
        renumbered[order] = np.arange(len(order))
        arrays = {}
        for side in ("src", "tgt"):
            lens = np.concatenate(sides[f"{side}_lens"]) if sides[side] else np.zeros(0, np.int64)
            arrays[side] = np.concatenate(sides[side]) if sides[side] else np.zeros(0, np.int32)
            arrays[f"{side}_starts"] = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        tokens = self.src_lens[plan.items] + self.tgt_lens[plan.items]
        per_corpus = np.bincount(corpus, weights=tokens, minlength=len(self.parts)).astype(np.int64)
        return batching.Examples(**arrays), _renumber(plan, renumbered), per_corpus


def _take(flat: np.ndarray, starts: np.ndarray, local: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of examples `local` of one ragged array, back to back, and their lengths."""
    lens = starts[local + 1] - starts[local]
    out_starts = np.cumsum(lens) - lens
    index = np.repeat(starts[local] - out_starts, lens) + np.arange(int(lens.sum()))
    return flat[index], lens


def _renumber(plan: batching.Plan, items: np.ndarray) -> batching.Plan:
    return batching.Plan(items, plan.rows, plan.src_offsets, plan.tgt_offsets, plan.segment_ids, plan.shape)


class Mix:
    """The weighted draw of each stream position's corpus, and each corpus's own endless, reshuffled order.

    `kept[c]` are corpus c's global ids that passed the length filter; `probabilities[c]` its share of the draws.
    """

    def __init__(self, kept: Sequence[np.ndarray], probabilities: np.ndarray, names: Sequence[str], seed: int):
        self.kept, self.probabilities, self.seed = list(kept), probabilities, seed
        # A corpus's order depends on its name, not on its position in data.corpora.
        self.keys = [zlib.crc32(name.encode("utf-8")) for name in names]
        self._orders: dict[tuple[int, int], np.ndarray] = {}

    def order(self, corpus: int, epoch: int) -> np.ndarray:
        """Corpus `corpus`'s kept ids in epoch `epoch`: a fresh permutation for every (seed, corpus name, epoch)."""
        key = (corpus, epoch)
        if key not in self._orders:
            if len(self._orders) > 2 * len(self.kept):
                self._orders.clear()
            perm = np.random.default_rng([self.seed, self.keys[corpus], epoch]).permutation(len(self.kept[corpus]))
            self._orders[key] = self.kept[corpus][perm]
        return self._orders[key]

    def _stream(self, corpus: int, start: int, stop: int) -> np.ndarray:
        n = len(self.kept[corpus])
        parts = [np.zeros(0, np.int64)]
        for epoch in range(start // n, (stop - 1) // n + 1) if stop > start else ():
            lo, hi = max(start - epoch * n, 0), min(stop - epoch * n, n)
            parts.append(self.order(corpus, epoch)[lo:hi])
        return np.concatenate(parts)

    def window(self, window: int, size: int, consumed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the `size` global ids of window `window`, each corpus's pairs consumed after it), given those before."""
        rng = np.random.default_rng([self.seed, window, MIX_SEED])
        choice = rng.choice(len(self.kept), size=size, p=self.probabilities)
        counts = np.bincount(choice, minlength=len(self.kept))
        items = np.empty(size, np.int64)
        for c, count in enumerate(counts.tolist()):
            items[choice == c] = self._stream(c, int(consumed[c]), int(consumed[c]) + count)
        return items, consumed + counts
