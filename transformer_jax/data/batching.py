"""Tokenized examples as ragged numpy arrays (of one corpus or several), the three batching plans (pack, bucket,
pad) and batch assembly.

A plan says where each example of a batch goes: its row, its offset in that row on each side and its segment id.
`assemble` turns a plan into the batch contract, whose arrays `BATCH_KEYS` names (every module that builds or
consumes batches uses that tuple), with a handful of vectorised numpy operations:

  src_tokens      [B, S] int32  each sentence's ids then EOS, PAD at padding
  src_segment_ids [B, S] int32  1, 2, ... per example packed in the row, 0 at padding
  src_positions   [B, S] int32  0, 1, 2, ... restarting at each segment, 0 at padding
  tgt_in          [B, T] int32  BOS then the target ids, per segment; PAD at padding
  tgt_out         [B, T] int32  the target ids then EOS (tgt_in shifted left by one); PAD at padding
  tgt_segment_ids [B, T] int32  the same segment id k as the example's source side
  tgt_positions   [B, T] int32

Planners take the example ids of one window (carried-over ids first) and return the batches they can fill
completely plus the ids they leave over for the next window, so every batch has a fixed shape and no example is
dropped or repeated within an epoch.

The reserved ids (EOS, BOS, PAD) are the vocabulary's (model.layers.SpecialIds, the tokenizer's `ids`). Whether a slot
is real is its segment id's business (> 0), never its token's: BOS may equal PAD (Marian's decoder starts from pad).
"""

from __future__ import annotations

import dataclasses
import itertools
import zlib
from collections.abc import Callable, Sequence

import numpy as np

from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import DataError
from transformer_jax.model.layers import SpecialIds

ROW_MULTIPLE = 8  # default: bucket batches have a multiple of 8 rows, so they split evenly over up to 8 devices
MIN_EVAL_LENGTH = 16  # tokens; the shortest padded length of an evaluation batch
BATCH_KEYS = (
    "src_tokens",
    "src_segment_ids",
    "src_positions",
    "tgt_in",
    "tgt_out",
    "tgt_segment_ids",
    "tgt_positions",
)


@dataclasses.dataclass(frozen=True)
class Examples:
    """Tokenized pairs as ragged arrays: example i's source is src[src_starts[i]:src_starts[i+1]], with its EOS;
    its target is the ids then EOS (= tgt_out; tgt_in is derived when batching)."""

    src: np.ndarray  # int32 [total source tokens] (uint16 memory-mapped from a store; batches are int32 either way)
    src_starts: np.ndarray  # int64 [N + 1]
    tgt: np.ndarray  # int32 [total target tokens] (likewise)
    tgt_starts: np.ndarray  # int64 [N + 1]

    def __len__(self) -> int:
        return len(self.src_starts) - 1

    @property
    def src_lens(self) -> np.ndarray:
        """Tokens per source row segment, EOS included."""
        return np.diff(self.src_starts)

    @property
    def tgt_lens(self) -> np.ndarray:
        """Tokens per target row segment (len(y) + 1: tgt_in has BOS, tgt_out has EOS)."""
        return np.diff(self.tgt_starts)

    def empty(self) -> np.ndarray:
        """Whether each example has an empty side (EOS only): the length filter drops those."""
        return (self.src_lens <= 1) | (self.tgt_lens <= 1)

    def take(self, ids: np.ndarray) -> Examples:
        """Examples `ids`, copied into compact arrays in that order."""
        return Examples(*_take(self.src, self.src_starts, ids), *_take(self.tgt, self.tgt_starts, ids))

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(source ids with EOS, target ids without EOS) of example i."""
        src = self.src[self.src_starts[i] : self.src_starts[i + 1]]
        return src, self.tgt[self.tgt_starts[i] : self.tgt_starts[i + 1] - 1]


def ragged(ids: Sequence[Sequence[int]], eos: int, max_len: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates id lists with an EOS after each; with max_len, keeps at most max_len - 1 ids (EOS stays)."""
    if max_len is not None:
        ids = [x[: max_len - 1] for x in ids]
    lens = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
    flat = np.fromiter(itertools.chain.from_iterable(ids), dtype=np.int32, count=int(lens.sum()))
    out = np.full(len(flat) + len(ids), eos, dtype=np.int32)
    # Token j of sentence i moves right by i places, leaving one EOS slot after each sentence.
    out[np.arange(len(flat)) + np.repeat(np.arange(len(ids)), lens)] = flat
    starts = np.zeros(len(ids) + 1, dtype=np.int64)
    np.cumsum(lens + 1, out=starts[1:])
    return out, starts


def from_ids(
    src_ids: Sequence[Sequence[int]], tgt_ids: Sequence[Sequence[int]], max_len: int | None = None, *, eos: int
) -> Examples:
    """Examples of id lists (no EOS yet): each side gets `eos` appended, after at most max_len - 1 ids."""
    src, src_starts = ragged(src_ids, eos, max_len)
    tgt, tgt_starts = ragged(tgt_ids, eos, max_len)
    return Examples(src, src_starts, tgt, tgt_starts)


def _join(flats: list[np.ndarray], starts: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Concatenates ragged arrays, shifting each part's starts by the tokens before it."""
    offsets = np.cumsum([0] + [len(f) for f in flats])
    shifted = [s[:-1] + o for s, o in zip(starts, offsets[:-1], strict=True)]
    return np.concatenate(flats), np.concatenate([*shifted, offsets[-1:]])


def concat(parts: Sequence[Examples]) -> Examples:
    """The examples of `parts`, one part after another."""
    src = _join([p.src for p in parts], [p.src_starts for p in parts])
    return Examples(*src, *_join([p.tgt for p in parts], [p.tgt_starts for p in parts]))


def encode(pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, num_threads: int) -> Examples:
    """Examples of (non-empty) `pairs`, by the tokenizer's batch encoders on `num_threads` SentencePiece threads."""
    src_text, tgt_text = zip(*pairs, strict=True)
    src_ids = tokenizer.encode_source_batch(src_text, num_threads)
    return from_ids(src_ids, tokenizer.encode_target_batch(tgt_text, num_threads), eos=tokenizer.ids.eos)


def tokenize_pairs(
    pairs: Sequence[tuple[str, str]], tokenizer: Tokenizer, *, num_threads: int = 1, chunk: int = 100_000
) -> Examples:
    """Tokenizes pairs `chunk` at a time (`encode`), to bound the Python lists."""
    parts = [from_ids([], [], eos=tokenizer.ids.eos)]
    for start in range(0, len(pairs), chunk):
        parts.append(encode(pairs[start : start + chunk], tokenizer, num_threads))
    return parts[1] if len(parts) == 2 else concat(parts)


def length_filter(examples: Examples, max_len: int) -> tuple[np.ndarray, dict[str, int]]:
    """Ids of examples whose both sides are non-empty and at most max_len tokens (EOS counted), and the counts."""
    src_lens, tgt_lens = examples.src_lens, examples.tgt_lens
    empty = examples.empty()
    too_long = ~empty & ((src_lens > max_len) | (tgt_lens > max_len))
    kept = np.flatnonzero(~empty & ~too_long)
    return kept, {
        "examples": len(examples),
        "kept": len(kept),
        "dropped_empty": int(empty.sum()),
        "dropped_too_long": int(too_long.sum()),
    }


# ----------------------------------------------------------------------------------------------------------------
# Plans.


@dataclasses.dataclass(frozen=True)
class Plan:
    """Where each example of one batch goes."""

    items: np.ndarray  # example ids
    rows: np.ndarray  # row of each example
    src_offsets: np.ndarray  # first source slot of each example in its row
    tgt_offsets: np.ndarray
    segment_ids: np.ndarray  # 1-based segment id of each example within its row
    shape: tuple[int, int, int]  # (rows, source length S, target length T)


# A planner gets (example ids, how many of them are carried over) and a seeded generator, and returns
# (the plans of the full batches, the ids left for the next window).
Planner = Callable[[np.ndarray, int, np.random.Generator], tuple[list[Plan], np.ndarray]]


def one_per_row(items: np.ndarray, shape: tuple[int, int, int]) -> Plan:
    zeros = np.zeros(len(items), np.int64)
    return Plan(items, np.arange(len(items)), zeros, zeros, np.ones(len(items), np.int64), shape)


def host_rows(plan: Plan, index: int, count: int) -> Plan:
    """Host `index` of `count`'s share of a global batch: its block of rows, renumbered from 0. Every host plans
    the same global batches, so the hosts' shapes agree and their blocks together are the one-host batch."""
    rows, src_len, tgt_len = plan.shape
    if rows % count:
        raise DataError(f"a batch of {rows} rows does not split over {count} hosts; this is a bug")
    per_host = rows // count
    first = index * per_host
    mine = (plan.rows >= first) & (plan.rows < first + per_host)
    fields = (plan.items, plan.rows - first, plan.src_offsets, plan.tgt_offsets, plan.segment_ids)
    return Plan(*(field[mine] for field in fields), (per_host, src_len, tgt_len))


def real_tokens(examples: Examples, plan: Plan) -> int:
    """Tokens (not padding) of a plan's batch, both sides."""
    items = plan.items
    src = examples.src_starts[items + 1] - examples.src_starts[items]
    tgt = examples.tgt_starts[items + 1] - examples.tgt_starts[items]
    return int(src.sum() + tgt.sum())


def pad_planner(batch_rows: int, max_len: int) -> Planner:
    """One example per row, [batch_rows, max_len] on both sides."""

    def plan(items: np.ndarray, num_carried: int, rng: np.random.Generator) -> tuple[list[Plan], np.ndarray]:
        full = len(items) // batch_rows * batch_rows
        batches = items[:full].reshape(-1, batch_rows)
        return [one_per_row(b, (batch_rows, max_len, max_len)) for b in batches], items[full:]

    return plan


def bucket_lengths(max_len: int) -> list[int]:
    """Row lengths of the training buckets: multiples of 8 up to 64, then four steps per doubling, and max_len."""
    lengths, length, step = [], 8, 8
    while length < max_len:
        lengths.append(length)
        if length >= 64 and length & (length - 1) == 0:
            step = length // 4
        length += step
    return [*lengths, max_len]


def padded_eval_length(length: int, max_len: int) -> int:
    """The padded length of an evaluation batch whose longest row has `length` tokens: 16 * 2^k, capped at max_len.

    Evaluation (translation, validation loss) sees each input once, so it pads each batch to a few lengths that
    double, a handful of compilations per decoding setting; training batches use the finer `bucket_lengths`, which
    waste less padding on the many batches of every epoch.
    """
    padded = MIN_EVAL_LENGTH
    while padded < length:
        padded *= 2
    return min(padded, max_len)


def bucket_shapes(tokens_per_batch: int, max_len: int, row_multiple: int = ROW_MULTIPLE) -> list[tuple[int, int]]:
    """(rows, row length) of each bucket: about tokens_per_batch slots per side, rows a multiple of row_multiple."""
    shapes = []
    for length in bucket_lengths(max_len):
        rows = max(row_multiple, tokens_per_batch // length // row_multiple * row_multiple)
        shapes.append((rows, length))
    return shapes


def bucket_planner(src_lens: np.ndarray, tgt_lens: np.ndarray, shapes: Sequence[tuple[int, int]]) -> Planner:
    """Length buckets with token-count batching: one (rows, length) shape per bucket (`bucket_shapes`), S = T."""
    lengths = np.array([length for _, length in shapes])

    def plan(items: np.ndarray, num_carried: int, rng: np.random.Generator) -> tuple[list[Plan], np.ndarray]:
        bucket = np.searchsorted(lengths, np.maximum(src_lens[items], tgt_lens[items]))
        plans, left = [], []
        for b, (rows, length) in enumerate(shapes):
            members = items[bucket == b]  # stable: carried ids come first, then the shuffled order
            full = len(members) // rows * rows
            plans.extend(one_per_row(m, (rows, length, length)) for m in members[:full].reshape(-1, rows))
            left.append(members[full:])
        # Interleave the buckets so that consecutive steps see different lengths.
        order = rng.permutation(len(plans))
        return [plans[i] for i in order], np.concatenate(left)

    return plan


def first_fit(src_lens: np.ndarray, tgt_lens: np.ndarray, row_len: int) -> tuple[np.ndarray, ...]:
    """First-fit packing, in the given order, into rows of row_len slots per side: each example goes into the first
    row where both its sides fit. Returns (row, src_offset, tgt_offset, segment_id) per example."""
    n = len(src_lens)
    src_used = np.zeros(n + 1, np.int64)
    tgt_used = np.zeros(n + 1, np.int64)
    segments = np.zeros(n + 1, np.int64)
    row = np.empty(n, np.int64)
    src_off = np.empty(n, np.int64)
    tgt_off = np.empty(n, np.int64)
    seg = np.empty(n, np.int64)
    first_open, num_rows = 0, 0  # rows before first_open cannot take even the shortest example
    for i, (s, t) in enumerate(zip(src_lens.tolist(), tgt_lens.tolist(), strict=True)):
        lo = first_open
        fits = (src_used[lo : num_rows + 1] <= row_len - s) & (tgt_used[lo : num_rows + 1] <= row_len - t)
        r = lo + int(fits.argmax())  # row num_rows is empty, so some row always fits
        row[i], src_off[i], tgt_off[i] = r, src_used[r], tgt_used[r]
        src_used[r] += s
        tgt_used[r] += t
        segments[r] += 1
        seg[i] = segments[r]
        num_rows = max(num_rows, r + 1)
        while first_open < num_rows and (src_used[first_open] > row_len - 2 or tgt_used[first_open] > row_len - 2):
            first_open += 1
    return row, src_off, tgt_off, seg


def pack_planner(src_lens: np.ndarray, tgt_lens: np.ndarray, batch_rows: int, row_len: int) -> Planner:
    """Packs a window first-fit-decreasing, emits its fullest rows as batches and carries over the rest.

    Carried examples are placed first so none waits more than a window or two; the rows a window cannot fill
    (usually the last few) go back into the next window instead of being emitted half empty. Hand-written rather
    than grain's FirstFitPackIterDataset, which packs in arrival order and emits all its bins, partly empty ones
    included, as soon as one example does not fit; and which packs per host, where this plans the same global
    batches on every host (see pipeline).
    """

    def plan(items: np.ndarray, num_carried: int, rng: np.random.Generator) -> tuple[list[Plan], np.ndarray]:
        s, t = src_lens[items], tgt_lens[items]
        is_new = np.arange(len(items)) >= num_carried
        order = np.lexsort((-(s + t), is_new))  # carried first, then longest first
        items, s, t = items[order], s[order], t[order]
        row, src_off, tgt_off, seg = first_fit(s, t, row_len)
        num_rows = int(row.max()) + 1 if len(row) else 0
        fill = np.bincount(row, weights=s + t, minlength=num_rows)
        num_batches = num_rows // batch_rows
        emitted = np.argsort(-fill, kind="stable")[: num_batches * batch_rows]
        # Rows of a batch are drawn at random from the emitted rows, so each batch mixes long and short examples.
        emitted = rng.permutation(emitted)
        batch_of_row = np.full(num_rows, -1)
        row_in_batch = np.zeros(num_rows, np.int64)
        batch_of_row[emitted] = np.arange(len(emitted)) // batch_rows
        row_in_batch[emitted] = np.arange(len(emitted)) % batch_rows
        batch = batch_of_row[row]
        plans = []
        for b in range(num_batches):
            m = batch == b
            plans.append(
                Plan(items[m], row_in_batch[row[m]], src_off[m], tgt_off[m], seg[m], (batch_rows, row_len, row_len))
            )
        return plans, items[batch < 0]

    return plan


# ----------------------------------------------------------------------------------------------------------------
# Assembly.


def _scatter(flat: np.ndarray, starts: np.ndarray, plan: Plan, offsets: np.ndarray, length: int):
    """Token, source index, segment id and position of every slot a plan fills on one side."""
    begin = starts[plan.items]
    lens = starts[plan.items + 1] - begin
    total = int(lens.sum())
    pos = np.arange(total) - np.repeat(np.cumsum(lens) - lens, lens)
    dest = np.repeat(plan.rows * length + offsets, lens) + pos
    if np.any(offsets + lens > length):
        raise DataError(f"an example longer than the row length {length} reached batching; this is a bug")
    return dest, np.repeat(begin, lens) + pos, np.repeat(plan.segment_ids, lens), pos


def assemble(examples: Examples, plan: Plan, ids: SpecialIds) -> dict[str, np.ndarray]:
    """The batch dict of a plan; all arrays int32; wherever a slot holds no token, PAD in the token arrays and 0 in
    the others."""
    num_rows, src_len, tgt_len = plan.shape
    batch = {}
    dest, index, seg, pos = _scatter(examples.src, examples.src_starts, plan, plan.src_offsets, src_len)
    for key, values in (("src_tokens", examples.src[index]), ("src_segment_ids", seg), ("src_positions", pos)):
        batch[key] = np.full(num_rows * src_len, ids.pad if key == "src_tokens" else 0, np.int32)
        batch[key][dest] = values
    dest, index, seg, pos = _scatter(examples.tgt, examples.tgt_starts, plan, plan.tgt_offsets, tgt_len)
    # tgt_in is tgt_out shifted right by one within each segment, with BOS in front.
    tgt_in = np.where(pos == 0, ids.bos, examples.tgt[index - 1])
    for key, values in (
        ("tgt_in", tgt_in),
        ("tgt_out", examples.tgt[index]),
        ("tgt_segment_ids", seg),
        ("tgt_positions", pos),
    ):
        batch[key] = np.full(num_rows * tgt_len, ids.pad if key in ("tgt_in", "tgt_out") else 0, np.int32)
        batch[key][dest] = values
    return {k: batch[k].reshape(num_rows, -1) for k in BATCH_KEYS}


def padding_efficiency(batches: Sequence[dict[str, np.ndarray]]) -> dict[str, float]:
    """Real tokens / slots on each side over some batches."""
    src = sum(int((b["src_segment_ids"] > 0).sum()) for b in batches)
    tgt = sum(int((b["tgt_segment_ids"] > 0).sum()) for b in batches)
    src_slots = sum(b["src_segment_ids"].size for b in batches)
    tgt_slots = sum(b["tgt_segment_ids"].size for b in batches)
    return {"src": src / max(src_slots, 1), "tgt": tgt / max(tgt_slots, 1)}


# ----------------------------------------------------------------------------------------------------------------
# Several corpora (data.corpora): one example id space, and their weighted, seeded, endless mix.
#
# `MixedExamples` puts corpus c's examples at global ids first[c] .. first[c + 1] - 1 without copying them (each
# part may be a memory-mapped store): the planners see the concatenated lengths, and `gather` copies just one
# batch's examples into a compact `Examples` that `assemble` turns into the batch.
#
# `Mix` is the stream: window w of the training stream (`pipeline.WindowBatchIterator`) draws, for each of its
# positions, the corpus of the next pair with probability weight / sum of weights (one vectorised
# `Generator.choice` seeded by (seed, w)), and takes each corpus's next pairs from that corpus's own endless
# stream, reshuffled every time it runs out by a permutation seeded by (seed, corpus name, epoch). The pairs each
# corpus has given before the window (`consumed`) are all the state a restart needs besides the window number.

MIX_SEED = 0x6D6978  # separates the corpus draws' seed sequence from the planners' (seed, window)


class MixedExamples:
    """The examples of several corpora or directions (`parts`, named by `names`, drawn with `weights`) under one id
    space. A part's `src_prefix` / `tgt_prefix` (a language token id, or None) is inserted when its examples are
    gathered for a batch: before the source, and as the target's first token (tgt_out = [LT, y..., EOS], so
    tgt_in = [BOS, LT, y...]); the lengths the planners and the length filter see count it."""

    def __init__(
        self,
        parts: Sequence[Examples],
        names: Sequence[str],
        weights: Sequence[float],
        src_prefix: Sequence[int | None] | None = None,
        tgt_prefix: Sequence[int | None] | None = None,
    ):
        self.parts, self.names = list(parts), list(names)
        self.probabilities = np.asarray(weights, np.float64) / np.sum(weights)
        self.src_prefix = list(src_prefix or [None] * len(self.parts))
        self.tgt_prefix = list(tgt_prefix or [None] * len(self.parts))
        self.first = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        self.src_lens = np.concatenate(
            [p.src_lens + (x is not None) for p, x in zip(self.parts, self.src_prefix, strict=True)]
        )
        self.tgt_lens = np.concatenate(
            [p.tgt_lens + (x is not None) for p, x in zip(self.parts, self.tgt_prefix, strict=True)]
        )

    def __len__(self) -> int:
        return int(self.first[-1])

    def empty(self) -> np.ndarray:
        """Whether each example has an empty side before any prefix (a blank line of a multi-way folder)."""
        return np.concatenate([p.empty() for p in self.parts])

    def corpus_of(self, ids: np.ndarray) -> np.ndarray:
        """The corpus index of each global example id."""
        return np.searchsorted(self.first, ids, side="right") - 1

    def gather(self, plan: Plan) -> tuple[Examples, Plan, np.ndarray]:
        """(the plan's examples copied into compact Examples, prefixes inserted, the plan renumbered to them, real
        tokens per part)."""
        corpus = self.corpus_of(plan.items)
        order = np.argsort(corpus, kind="stable")  # the plan's examples grouped by corpus
        ids = plan.items[order]
        examples = concat(
            [
                _prefixed(
                    self.parts[c].take(ids[corpus[order] == c] - self.first[c]), self.src_prefix[c], self.tgt_prefix[c]
                )
                for c in np.unique(corpus)
            ]
        )
        renumbered = np.empty(len(order), np.int64)
        renumbered[order] = np.arange(len(order))
        tokens = self.src_lens[plan.items] + self.tgt_lens[plan.items]
        per_corpus = np.bincount(corpus, weights=tokens, minlength=len(self.parts)).astype(np.int64)
        return examples, dataclasses.replace(plan, items=renumbered), per_corpus


def _prepend(flat: np.ndarray, starts: np.ndarray, token: int | None) -> tuple[np.ndarray, np.ndarray]:
    """A ragged array with `token` in front of every row (unchanged for None)."""
    if token is None:
        return flat, starts
    rows = len(starts) - 1
    new_starts = starts + np.arange(rows + 1)
    out = np.empty(len(flat) + rows, flat.dtype)
    first = np.zeros(len(out), bool)
    first[new_starts[:-1]] = True
    out[first] = token
    out[~first] = flat
    return out, new_starts


def _prefixed(examples: Examples, src_prefix: int | None, tgt_prefix: int | None) -> Examples:
    return Examples(
        *_prepend(examples.src, examples.src_starts, src_prefix),
        *_prepend(examples.tgt, examples.tgt_starts, tgt_prefix),
    )


def _take(flat: np.ndarray, starts: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of examples `ids` of one ragged array, back to back, and their starts there."""
    lens = starts[ids + 1] - starts[ids]
    out_starts = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    index = np.repeat(starts[ids] - out_starts[:-1], lens) + np.arange(int(lens.sum()))
    return flat[index], out_starts


class Epochs:
    """The ids `kept` as an endless stream, in a new order every epoch: the permutation seeded by (*seed, epoch)."""

    def __init__(self, kept: np.ndarray, seed: Sequence[int]):
        self.kept, self.seed = kept, list(seed)
        self._orders: dict[int, np.ndarray] = {}

    def order(self, epoch: int) -> np.ndarray:
        """The kept ids in epoch `epoch`'s order."""
        if epoch not in self._orders:
            if len(self._orders) > 2:
                self._orders.clear()
            perm = np.random.default_rng([*self.seed, epoch]).permutation(len(self.kept))
            self._orders[epoch] = self.kept[perm]
        return self._orders[epoch]

    def take(self, start: int, stop: int) -> np.ndarray:
        """Stream positions [start, stop): position p is order(p // n)[p % n]."""
        n = len(self.kept)
        parts = [np.zeros(0, np.int64)]
        for epoch in range(start // n, (stop - 1) // n + 1) if stop > start else ():
            lo, hi = max(start - epoch * n, 0), min(stop - epoch * n, n)
            parts.append(self.order(epoch)[lo:hi])
        return np.concatenate(parts)


class Mix:
    """The weighted draw of each stream position's corpus, and each corpus's own endless, reshuffled order:
    `kept[c]` are corpus c's global ids that passed the length filter, `probabilities[c]` its share of the draws."""

    def __init__(self, kept: Sequence[np.ndarray], probabilities: np.ndarray, names: Sequence[str], seed: int):
        self.probabilities, self.seed = probabilities, seed
        # A corpus's order depends on its name, not on its position in data.corpora.
        self.epochs = [Epochs(k, [seed, zlib.crc32(name.encode("utf-8"))]) for k, name in zip(kept, names, strict=True)]

    def window(self, window: int, size: int, consumed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(the `size` global ids of window `window`, each corpus's pairs consumed after it), given those before."""
        rng = np.random.default_rng([self.seed, window, MIX_SEED])
        choice = rng.choice(len(self.epochs), size=size, p=self.probabilities)
        counts = np.bincount(choice, minlength=len(self.epochs))
        items = np.empty(size, np.int64)
        for c, count in enumerate(counts.tolist()):
            items[choice == c] = self.epochs[c].take(int(consumed[c]), int(consumed[c]) + count)
        return items, consumed + counts
