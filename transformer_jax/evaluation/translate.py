"""Translate a list of sentences: tokenize, batch into a few fixed shapes, search, detokenize, in input order.

Batch shapes come from a small fixed set so that jit compiles a bounded number of times: every batch has exactly
`batch_size` rows (the last one is filled with dummy rows that are dropped; an input smaller than one batch gets
a batch of its size rounded up to a multiple of 8) and its source length is rounded up
to a bucket (16, 32, 64, ... up to max_input_len). Sentences are sorted by length so that a batch's rows are
similar, which wastes little padding and lets the search stop early for batches of short sentences.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
from flax import nnx

from transformer_jax import decoding
from transformer_jax.data.batching import padded_eval_length
from transformer_jax.tokens import EOS_ID, PAD_ID


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


# The rules of what is decoded, shared with every other engine that must decode exactly as we do
# (exporting/ctranslate2.py).


def source_ids(tokenizer: Tokenizer, sentence: str, max_input_len: int) -> tuple[list[int] | None, bool]:
    """(ids then EOS, cut to max_input_len - 1 ids + EOS; None for a blank line, which is not decoded), was_cut."""
    if not sentence.strip():
        return None, False
    ids = list(tokenizer.encode(sentence))
    cut = len(ids) + 1 > max_input_len
    return (ids[: max_input_len - 1] if cut else ids) + [EOS_ID], cut


def position_limit(spec: Any) -> int | None:
    """The most positions the model can encode or decode: a learned table's rows; None (no limit) otherwise."""
    return spec.max_len if spec.positional == "learned" else None


def input_limit(max_input_len: int, position_limit: int | None) -> int:
    """The most source tokens (EOS included) kept: max_input_len, and no more than a learned table has rows."""
    return max_input_len if position_limit is None else min(max_input_len, position_limit)


def output_limit(source_len: int, max_extra_len: int, position_limit: int | None) -> int:
    """The most tokens an output may have, EOS included: source tokens (EOS included) + max_extra_len, and no more
    than a learned position table has rows (`position_limit`; None for sinusoidal positions)."""
    limit = source_len + max_extra_len
    return limit if position_limit is None else min(limit, position_limit)


def translate(
    model: nnx.Module,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    *,
    beam_size: int,
    alpha: float,
    max_extra_len: int,
    batch_size: int,
    max_input_len: int,
    progress: bool = False,
) -> tuple[list[str], dict[str, Any]]:
    """One output per input sentence, in order, and statistics.

    Sources are the tokenizer's ids then EOS (as in training); a source with more than max_input_len tokens is cut
    to max_input_len - 1 ids + EOS and counted. An empty (or blank) line gives an empty output without decoding.
    Each output has at most (source tokens + max_extra_len) tokens, EOS included. beam_size 1 is greedy search.
    """
    if max_input_len < 2:
        raise ValueError(f"max_input_len must be >= 2 (one token and EOS), got {max_input_len}")
    if beam_size < 1 or batch_size < 1 or max_extra_len < 1:
        raise ValueError(
            f"beam_size, batch_size, max_extra_len must be >= 1; got {beam_size}, {batch_size}, {max_extra_len}"
        )
    start = time.perf_counter()
    limit = position_limit(model.spec)
    max_input_len = input_limit(max_input_len, limit)

    outputs = [""] * len(sentences)
    sources: dict[int, list[int]] = {}
    truncated_lines = []
    for i, sentence in enumerate(sentences):
        ids, cut = source_ids(tokenizer, sentence, max_input_len)
        if ids is not None:
            sources[i] = ids
        if cut:
            truncated_lines.append(i + 1)

    order = sorted(sources, key=lambda i: len(sources[i]))
    batches = [order[j : j + batch_size] for j in range(0, len(order), batch_size)]
    # Fewer sentences than a batch: a batch of only as many rows as needed (a multiple of 8), not of batch_size.
    rows_per_batch = min(batch_size, -(-len(order) // 8) * 8)
    stats: dict[str, Any] = {
        "sentences": len(sentences),
        "empty": len(sentences) - len(sources),
        "truncated": len(truncated_lines),
        "truncated_lines": truncated_lines[:100],  # 1-based line numbers, the first 100
        "hit_max_len": 0,
        "batches": len(batches),
        "src_tokens": int(sum(len(s) for s in sources.values())),
        "tgt_tokens": 0,
        "shapes": set(),
    }
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(order), desc="translating", unit="sent", file=sys.stderr)
    search = decoding.searcher(model)
    for rows in batches:
        src_len = padded_eval_length(max(len(sources[i]) for i in rows), max_input_len)
        max_steps = output_limit(src_len, max_extra_len, limit)
        src_BS = np.full((rows_per_batch, src_len), PAD_ID, np.int32)
        src_BS[:, 0] = EOS_ID  # dummy rows: an empty source, decoded for one step and dropped
        max_len_B = np.ones((rows_per_batch,), np.int32)
        for r, i in enumerate(rows):
            src_BS[r, : len(sources[i])] = sources[i]
            max_len_B[r] = output_limit(len(sources[i]), max_extra_len, limit)
        result = search(src_BS, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps)
        tokens_BL = np.asarray(result.tokens[:, 0])
        lengths_B = np.asarray(result.lengths[:, 0])
        stats["shapes"].add((rows_per_batch, src_len, max_steps))
        for r, i in enumerate(rows):
            n = int(lengths_B[r])
            ids = tokens_BL[r, :n].tolist()
            if ids and ids[-1] == EOS_ID:
                ids = ids[:-1]
            else:
                stats["hit_max_len"] += 1  # stopped by the length limit, not by EOS
            stats["tgt_tokens"] += n
            outputs[i] = tokenizer.decode([t for t in ids if t != PAD_ID])
        if bar is not None:
            bar.update(len(rows))
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    stats["shapes"] = sorted(stats["shapes"])
    stats["seconds"] = round(seconds, 3)
    stats["sentences_per_s"] = round(len(sentences) / seconds, 2) if seconds > 0 else None
    return outputs, stats
