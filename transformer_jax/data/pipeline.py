"""The training and evaluation input pipelines: config -> batches of the contract in `batching`, placed on the
devices.

Training: the training split is tokenized once (into the memory-mapped store of `store`, or in memory),
length-filtered (counts reported), and streamed forever, in a new order every epoch (`batching.Epochs`). Batches
are planned from the lengths and assembled from the token arrays, which may be memory-mapped: nothing here holds
the corpus in Python objects. A window of `batch_window` shuffled example ids at a time is packed, bucketed or
padded into fixed-shape global batches. The iterator is a grain `DatasetIterator` whose state is (window,
carried-over ids, batches already emitted from the window): restoring it recomputes that window and continues with
exactly the next batch. The epoch order is one numpy permutation rather than grain's `MapDataset.shuffle`, whose
per-index Feistel shuffle costs microseconds per element, enough alone to cap the pipeline's throughput
(docs/benchmarks.md).

Several hosts: every host opens the same store (or tokenizes the whole split) and plans the same global batches
(same seed), then assembles only its block of rows (`batching.host_rows`). So the hosts always agree on each
batch's shape, their iterator states are identical (a checkpoint stores host 0's), and N hosts train on exactly
the batches one host would.

Several corpora (data.corpora): their examples share one id space (`batching.MixedExamples`), and each window's
positions are drawn from the corpora by weight (`batching.Mix`); the iterator state then also holds how many pairs
each corpus gave before the window.

`prefetch` assembles batches and places this host's rows on its devices a few batches ahead, on grain's prefetch
thread, so the training loop never waits for its next batch. Evaluation keeps every input in order: one sentence
per row, long inputs truncated (counted), and `example_index` -1 on rows that only fill up the last batch.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Iterator, Sequence
from typing import Any

import grain
import jax
import ml_collections
import numpy as np
from absl import logging

from transformer_jax.data import batching, languages, sources, store
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import DataError
from transformer_jax.model.layers import SpecialIds


@dataclasses.dataclass(frozen=True)
class StreamSpec:
    """What fixes the training batches: the examples, which of them are kept, how a window becomes batches, the
    window size, the shuffle seed, and which block of each global batch's rows this host takes (index, count)."""

    examples: batching.Examples | batching.MixedExamples
    kept: np.ndarray
    planner: batching.Planner
    window: int
    seed: int
    ids: SpecialIds  # the vocabulary's reserved ids: PAD and BOS of the assembled batches
    host: tuple[int, int] = (0, 1)


class WindowBatchIterator(grain.DatasetIterator):
    """Batches from consecutive windows of the endless, epoch-shuffled stream of kept examples: window w is
    positions [w * window, (w + 1) * window) of `batching.Epochs` (with several corpora, `batching.Mix.window`'s)
    after the ids the previous window carried over. `last_corpus_tokens`: the real tokens of each corpus in the
    global batch last returned (empty with one corpus)."""

    def __init__(self, spec: StreamSpec):
        super().__init__()
        self._spec = spec
        # The global batch behind the batch last returned: real tokens of all hosts and (rows, S, T) of all hosts.
        self.last_real_tokens, self.last_global_shape = 0, (0, 0, 0)
        self._window = 0
        self._carry = np.zeros(0, np.int64)  # example ids carried into the current window
        self._emitted = 0
        self._plans: list[batching.Plan] | None = None  # the current window's batches, computed lazily
        self._next_carry = np.zeros(0, np.int64)
        self._epochs = batching.Epochs(spec.kept, [spec.seed])
        self.last_corpus_tokens: dict[str, int] = {}
        self._mix, examples = None, spec.examples
        if isinstance(examples, batching.MixedExamples):
            corpus = examples.corpus_of(spec.kept)
            kept = [spec.kept[corpus == c] for c in range(len(examples.parts))]
            self._mix = batching.Mix(kept, examples.probabilities, examples.names, spec.seed)
            self._consumed = self._next_consumed = np.zeros(len(kept), np.int64)  # pairs per corpus before window

    @property
    def epoch(self) -> int:
        """The epoch (pass over the kept examples) that the current window starts in."""
        return self._window * self._spec.window // len(self._spec.kept)

    def _plan_window(self) -> None:
        if self._mix is None:
            start = self._window * self._spec.window
            stream = self._epochs.take(start, start + self._spec.window)
        else:
            stream, self._next_consumed = self._mix.window(self._window, self._spec.window, self._consumed)
        items = np.concatenate([self._carry, stream])
        rng = np.random.default_rng([self._spec.seed, self._window])
        self._plans, self._next_carry = self._spec.planner(items, len(self._carry), rng)

    def __next__(self) -> dict[str, np.ndarray]:
        if self._plans is None:
            self._plan_window()
        while self._emitted >= len(self._plans):
            self._window, self._carry, self._emitted = self._window + 1, self._next_carry, 0
            if self._mix is not None:
                self._consumed = self._next_consumed
            self._plan_window()
        plan = self._plans[self._emitted]
        self._emitted += 1
        examples, host = self._spec.examples, self._spec.host
        if self._mix is not None:
            examples, plan, per_corpus = examples.gather(plan)
            self.last_corpus_tokens = dict(zip(self._spec.examples.names, per_corpus.tolist(), strict=True))
        self.last_real_tokens, self.last_global_shape = batching.real_tokens(examples, plan), plan.shape
        if host[1] > 1:
            plan = batching.host_rows(plan, *host)
        return batching.assemble(examples, plan, self._spec.ids)

    def get_state(self) -> dict[str, Any]:
        """A JSON-serialisable position: restoring it continues with exactly the batch that would come next."""
        state = {"window": self._window, "carry": self._carry.tolist(), "emitted": self._emitted}
        if self._mix is not None:
            state["consumed"] = self._consumed.tolist()
        return state

    def set_state(self, state: dict[str, Any]) -> None:
        self._window = int(state["window"])
        self._carry = np.asarray(state["carry"], np.int64)
        self._emitted = int(state["emitted"])
        if self._mix is not None:
            if len(state.get("consumed", ())) != len(self._consumed):
                raise DataError(
                    f"the checkpoint's data position is for {len(state.get('consumed', ()))} corpora, but "
                    f"data.corpora names {len(self._consumed)}; resume with the run's data.corpora"
                )
            self._consumed = np.asarray(state["consumed"], np.int64)
        self._plans = None


def batch_shapes(
    config: ml_collections.ConfigDict, process_count: int, row_multiple: int = batching.ROW_MULTIPLE
) -> list[tuple[int, int, int]]:
    """The global shapes (rows, S, T) of every batch that `config.batching` can produce, no data needed: the
    planners' and those `train.py --dry_run` reports. Rows and tokens per batch are summed over all hosts; every
    batch must split into equal blocks of rows per host."""
    if config.batching in ("pack", "pad"):
        rows = config.batch_size
        if rows % process_count:
            raise DataError(
                f"data.batch_size={rows} is summed over hosts and must be a multiple of {process_count} hosts"
            )
        return [(rows, config.max_len, config.max_len)]
    if config.batching == "bucket":
        row_multiple = math.lcm(row_multiple, process_count)  # every host gets the same number of rows
        return [(r, n, n) for r, n in batching.bucket_shapes(config.tokens_per_batch, config.max_len, row_multiple)]
    raise DataError(f"unknown data.batching {config.batching!r}; choose pack, bucket or pad")


def make_train_iterator(
    config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    *,
    examples: batching.Examples | None = None,
    seed: int | None = None,
    process_index: int | None = None,
    process_count: int | None = None,
    num_threads: int | None = None,
    row_multiple: int = batching.ROW_MULTIPLE,
) -> tuple[WindowBatchIterator, dict[str, Any]]:
    """An endless iterator of this host's rows of the training batches, and the stats of how it was built.

    `config` is the data group. `examples` are the tokenized training pairs when already at hand: the
    memory-mapped store (`store.open_train_store`), which training uses; None reads and tokenizes the split in
    memory (small corpora, tests), which gives the same examples. seed defaults to config.shuffle_seed, the host
    to jax.process_index()/count(), num_threads (SentencePiece threads for the in-memory tokenization) to every
    core. Bucket batches have a multiple of row_multiple rows in all (make it all devices x micro-batches if that
    exceeds 8). Stats (all global): examples, kept, dropped_empty, dropped_too_long, src_tokens/tgt_tokens (kept,
    per epoch), batch_shapes.
    """
    seed = config.shuffle_seed if seed is None else seed
    process_index = jax.process_index() if process_index is None else process_index
    process_count = jax.process_count() if process_count is None else process_count
    if not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is not in [0, {process_count})")
    if examples is None:
        examples = tokenize_in_memory(config, tokenizer, num_threads or os.cpu_count() or 1)
    kept, stats = batching.length_filter(examples, config.max_len)
    if not len(kept):
        raise DataError(
            f"no training pair of split {config.train_split!r} is non-empty and at most "
            f"data.max_len={config.max_len} tokens per side ({stats})"
        )
    if isinstance(examples, batching.MixedExamples):
        kept_per_corpus = np.bincount(examples.corpus_of(kept), minlength=len(examples.parts))
        for name, count in zip(examples.names, kept_per_corpus.tolist(), strict=True):
            if not count:
                raise DataError(
                    f"data.corpora: corpus {name!r} has no training pair that is non-empty and at most "
                    f"data.max_len={config.max_len} tokens per side"
                )
            stats[f"kept_{name}"] = count
    shapes, lens = batch_shapes(config, process_count, row_multiple), (examples.src_lens, examples.tgt_lens)
    if config.batching == "pad":
        planner = batching.pad_planner(config.batch_size, config.max_len)
    elif config.batching == "pack":
        planner = batching.pack_planner(*lens, config.batch_size, config.max_len)
    else:
        planner = batching.bucket_planner(*lens, [(rows, length) for rows, length, _ in shapes])
    spec = StreamSpec(examples, kept, planner, config.batch_window, seed, tokenizer.ids, (process_index, process_count))
    stats.update(
        src_tokens=int(examples.src_lens[kept].sum()),
        tgt_tokens=int(examples.tgt_lens[kept].sum()),
        batch_shapes=shapes,
    )
    logging.info("train split %r, host %d of %d: %s", config.train_split, process_index, process_count, stats)
    return WindowBatchIterator(spec), stats


def tokenize_in_memory(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, num_threads: int
) -> batching.Examples | batching.MixedExamples:
    """The training examples tokenized in memory (data.store=False): the split of data.source, or each corpus of
    data.corpora (tags applied) as one `MixedExamples`."""
    mix = sources.corpora(config)
    if not mix:
        pairs = sources.read_all(sources.open_split(config, config.train_split))
        return batching.tokenize_pairs(pairs, tokenizer, num_threads=num_threads)
    parts = []
    for corpus in mix:
        chunks = sources.open_corpus(config, corpus).chunks(1 << 16)
        pairs = [pair for _, chunk in chunks for pair in sources.tagged(chunk, corpus.tag)]
        parts.append(batching.tokenize_pairs(pairs, tokenizer, num_threads=num_threads))
    return batching.MixedExamples(parts, [c.name for c in mix], [c.weight for c in mix])


def multilingual_examples(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, *, build_if_missing: bool, num_threads: int | None = None
) -> batching.MixedExamples:
    """The training examples of a multilingual run (`config` the full config, data.directions explicit): one part
    per direction, its two language sides' arrays (each side tokenized and stored once: store.open_sides), its
    language tokens by model.lang_token, drawn with the temperature's probabilities (languages.probabilities; a
    direction's size is its lines, blank ones included, before the length filter; data.direction_lines keeps a
    direction to its first lines)."""
    data, directions = config.data, languages.directions(config.data)
    langs = sorted({lang for d in directions for lang in (d.src, d.tgt)})
    files = languages.multiway_sides(data.text_dir, data.train_split, langs)
    sides = store.open_sides(
        data, tokenizer, files, store=data.store, build_if_missing=build_if_missing, num_threads=num_threads
    )
    placement, limits = languages.Placement.of(config), languages.line_limits(data)
    parts = []
    for d in directions:
        (src, src_starts), (tgt, tgt_starts) = sides[d.src], sides[d.tgt]
        n = min(limits.get(d.name, len(src_starts) - 1), len(src_starts) - 1)  # the first n lines: views, no copy
        parts.append(batching.Examples(src, src_starts[: n + 1], tgt, tgt_starts[: n + 1]))
    return batching.MixedExamples(
        parts,
        [d.name for d in directions],
        languages.probabilities([len(p) for p in parts], data.temperature),
        [placement.source_prefix(d) for d in directions],
        [placement.target_prefix(d) for d in directions],
    )


class PlacedBatches(grain.DatasetIterator):
    """The training batches placed on the devices, each with the real tokens and the shape (rows, S, T) of its
    global batch (all hosts), for throughput and FLOPs; its state is the data iterator's."""

    def __init__(self, parent: WindowBatchIterator, sharding):
        super().__init__(parent)
        self._sharding = sharding

    def __next__(self) -> tuple[dict[str, jax.Array], int, tuple[int, int, int]]:
        batch = next(self._parent)
        placed = {k: place(batch[k], self._sharding) for k in batching.BATCH_KEYS}
        tokens = (self._parent.last_real_tokens, self._parent.last_corpus_tokens)
        return placed, tokens, self._parent.last_global_shape

    def get_state(self) -> dict[str, Any]:
        return self._parent.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self._parent.set_state(state)


def prefetch(iterator: WindowBatchIterator, sharding, depth: int = 2) -> grain.DatasetIterator:
    """Placed batches prepared `depth` ahead on grain's prefetch thread. Its get_state() after each batch is the
    data iterator's right after that batch; an exception in the data iterator is raised by next() as itself."""
    return grain.experimental.ThreadPrefetchDatasetIterator(PlacedBatches(iterator, sharding), depth)


def place(array: np.ndarray, sharding) -> jax.Array:
    """This host's rows of a global batch, placed on its devices (multi-host aware)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(array, np.int32))


def eval_batches(
    sentences: Sequence[str],
    tokenizer: Tokenizer,
    batch_size: int,
    max_len: int,
    *,
    targets: Sequence[str] | None = None,
    source_prefix: int | None = None,
    target_prefix: int | None = None,
) -> tuple[Iterator[dict[str, np.ndarray]], dict[str, int]]:
    """Batches that keep every sentence, in order: [batch_size, max_len] per side, one sentence per row, and
    `example_index` [B] (-1 on rows that only pad the last batch). Longer sentences are cut to max_len - 1 ids plus
    EOS and counted. With `targets` (validation loss), the contract's target keys too. A multilingual run's language
    ids (`languages.Placement`) go where training's batches have them: `source_prefix` before every source's ids,
    `target_prefix` before every target's (so tgt_in = [BOS, LT, y...], tgt_out = [LT, y..., EOS]); max_len counts
    them."""
    src_ids = tokenizer.encode_source_batch(sentences)
    tgt_ids = tokenizer.encode_target_batch(targets) if targets is not None else [[] for _ in sentences]
    if source_prefix is not None:
        src_ids = [[source_prefix, *ids] for ids in src_ids]
    if target_prefix is not None and targets is not None:
        tgt_ids = [[target_prefix, *ids] for ids in tgt_ids]
    if len(tgt_ids) != len(src_ids):
        raise DataError(f"eval_batches: {len(src_ids)} sentences but {len(tgt_ids)} targets")
    stats = {
        "sentences": len(src_ids),
        "truncated": sum(len(x) + 1 > max_len for x in src_ids),
        "truncated_targets": sum(len(y) + 1 > max_len for y in tgt_ids) if targets is not None else 0,
        "batches": -(-len(src_ids) // batch_size),
    }
    if stats["truncated"] or stats["truncated_targets"]:
        truncated = stats["truncated"], stats["truncated_targets"]
        logging.warning("eval: truncated %d sources and %d targets to %d tokens", *truncated, max_len)
    examples = batching.from_ids(src_ids, tgt_ids, max_len, eos=tokenizer.ids.eos)

    def generate() -> Iterator[dict[str, np.ndarray]]:
        for start in range(0, len(examples), batch_size):
            items = np.arange(start, min(start + batch_size, len(examples)))
            plan = batching.one_per_row(items, (batch_size, max_len, max_len))
            batch = batching.assemble(examples, plan, tokenizer.ids)
            if targets is None:
                batch = {k: v for k, v in batch.items() if k.startswith("src_")}
            batch["example_index"] = np.full(batch_size, -1, np.int32)
            batch["example_index"][: len(items)] = items
            yield batch

    return generate(), stats
