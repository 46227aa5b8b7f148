"""Forced decoding: the model's log-probability of given targets (filtering data, noisy-channel reranking, analysis).

Each pair is tokenized and cut as validation cuts it (data.batching.from_ids: at most max_len - 1 ids then EOS per
side) and teacher-forced through the model: log P(y | x) = sum over t of log P(y_t | y_<t, x), the target's tokens
then EOS. Pairs are packed several to a row (first fit, longest first: data.batching.first_fit), each its own
segment, into rows of one length (the doubling bucket of the longest side, data.batching.padded_eval_length), in
batches of `batch_size` rows: one compiled shape, and about as many slots as tokens (one pair a row padded to its
batch's bucket filled half of test2016's slots, docs/decoding.md). The per-token sums are those of the
training loss's nll (training/step.py, without label smoothing), so the corpus perplexity exp(-sum log P / tokens)
is exp of the validation nll on the same pairs. An ensemble (decoding/ensemble.py) scores with the distribution its
search uses, the renormalised mean of its members' log-probabilities at every target position.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax.data import batching
from transformer_jax.evaluation.translate import NO_LANGUAGE, LanguageIds, Tokenizer, input_limit, position_limit
from transformer_jax.runtime import Progress
from transformer_jax.training.step import batch_logits

Array = jax.Array


class SentenceScore(NamedTuple):
    log_prob: float  # log P(target | source): the sum over the target's tokens, EOS included
    tokens: int  # target tokens scored, EOS included

    @property
    def mean(self) -> float:  # per token
        return self.log_prob / self.tokens


@functools.partial(jax.jit, static_argnames=("graphdef",))
def _token_log_probs(graphdef: nnx.GraphDef, state: nnx.State, batch: dict[str, Array]) -> Array:
    """[B, T] log P(tgt_out | tgt_in, source) of every target slot; 0 on padding."""
    model = nnx.merge(graphdef, state)
    logits_BTV = batch_logits(model, batch).astype(jnp.float32)
    # log_softmax at the target, as training/step.py computes the nll: logit - logsumexp.
    lse_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, batch["tgt_out"][..., None], axis=-1)[..., 0]
    return jnp.where(batch["tgt_segment_ids"] > 0, target_BT - lse_BT, 0.0)


def score_pairs(
    model: nnx.Module,
    tokenizer: Tokenizer,
    sources: Sequence[str],
    targets: Sequence[str],
    *,
    batch_size: int,
    max_len: int,
    progress: bool = False,
    language_ids: LanguageIds | None = None,
) -> tuple[list[SentenceScore], dict[str, Any]]:
    """Every pair's SentenceScore, in input order, and statistics with the corpus perplexity.

    Sources and targets are cut to max_len tokens (EOS included; no more than a learned position table has rows),
    as validation cuts them; blank lines are scored as empty sentences (EOS only). Runs the model in eval mode
    without changing the caller's model.

    language_ids: a multilingual model's direction, its tokens placed as training places them (the source's before
    the source, the target's first in the target); a forced target token is teacher-forced but neither scored nor
    counted, as decoding forces it with probability 1.
    """
    if len(sources) != len(targets):
        raise ValueError(f"{len(sources)} sources but {len(targets)} targets")
    start = time.perf_counter()
    limit = input_limit(max_len, position_limit(model.spec))
    src_ids, tgt_ids = tokenizer.encode_source_batch(sources), tokenizer.encode_target_batch(targets)
    lang = language_ids or NO_LANGUAGE
    if lang.source is not None:
        src_ids = [[lang.source, *ids] for ids in src_ids]
    forced = int(lang.target is not None)  # target slots not scored: the forced language token
    if forced:
        tgt_ids = [[lang.target, *ids] for ids in tgt_ids]
    examples = batching.from_ids(src_ids, tgt_ids, limit, eos=tokenizer.ids.eos)
    graphdef, state = nnx.split(model)
    copy = nnx.merge(graphdef, state)
    copy.eval()
    graphdef, state = nnx.split(copy)

    log_probs, tokens = np.zeros(len(examples)), examples.tgt_lens - forced
    longest = int(max(examples.src_lens.max(initial=1), examples.tgt_lens.max(initial=1)))
    row_len = batching.padded_eval_length(longest, limit)
    bar = Progress(len(examples), "scoring", "sentences") if progress else None
    for plan in packed_batches(examples, batch_size, row_len):
        batch = batching.assemble(examples, plan, tokenizer.ids)
        log_probs_BT = np.asarray(_token_log_probs(graphdef, state, batch), np.float64)
        # Each pair's sum over its own slots (its segment of its row), from prefix sums of the flat batch.
        prefix = np.concatenate([[0.0], np.cumsum(log_probs_BT.reshape(-1))])
        first = plan.rows * row_len + plan.tgt_offsets + forced
        log_probs[plan.items] = prefix[first + tokens[plan.items]] - prefix[first]
        if bar is not None:
            bar.update(len(plan.items))
    if bar is not None:
        bar.close()
    scores = [SentenceScore(float(lp), int(n)) for lp, n in zip(log_probs, tokens, strict=True)]
    total, count = float(log_probs.sum()), int(tokens.sum())
    seconds = time.perf_counter() - start
    stats = {
        "sentences": len(scores),
        "tokens": count,
        "log_prob": total,
        "nll_per_token": -total / count if count else None,
        "perplexity": math.exp(-total / count) if count else None,
        "truncated_sources": sum(len(x) + 1 > limit for x in src_ids),
        "truncated_targets": sum(len(y) + 1 > limit for y in tgt_ids),  # the forced token counts in the cut
        "seconds": round(seconds, 3),
    }
    return scores, stats


def packed_batches(examples: batching.Examples, batch_size: int, row_len: int) -> Iterable[batching.Plan]:
    """Every pair, packed first fit (longest first) into rows of row_len slots a side, in plans of at most batch_size
    rows: the fewest batches, of equal rows (a multiple of 8), so that the last is not mostly empty rows."""
    order = np.argsort(-(examples.src_lens + examples.tgt_lens), kind="stable")
    row, src_off, tgt_off, seg = batching.first_fit(examples.src_lens[order], examples.tgt_lens[order], row_len)
    used = int(row.max(initial=-1)) + 1
    if not used:
        return
    per_batch = -(-used // max(1, -(-used // batch_size)))  # the used rows spread evenly over the fewest batches
    rows = min(batch_size, -(-per_batch // 8) * 8)
    for first in range(0, used, rows):
        mine = (row >= first) & (row < first + rows)
        yield batching.Plan(
            order[mine], row[mine] - first, src_off[mine], tgt_off[mine], seg[mine], (rows, row_len, row_len)
        )


def score_lines(scores: Sequence[SentenceScore]) -> list[str]:
    """One line per pair: the sum log-probability, the per-token mean and the token count, tab-separated."""
    return [f"{s.log_prob:.6f}\t{s.mean:.6f}\t{s.tokens}" for s in scores]
