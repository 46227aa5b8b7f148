"""Greedy and beam search over a generic decode step, and the binding that runs them on the Transformer.

Axis letters: see transformer_jax/__init__.py (here B sentences, W beams per sentence, R = B W rows with row b W + w
beam w of sentence b, L output slots = max_steps).

A decode step is `decode_step(tokens_R1, cache) -> (logits_R1V, cache)`: it reads the next input token of every
row and returns the next-token logits. The cache is any pytree whose non-scalar leaves have the rows on axis 0
(scalar leaves, such as the model's write `index`, are shared by all rows and never tiled or reordered). The
search functions only need this interface, so tests drive them with stubs whose distributions they control.

Search (both functions; the reserved ids are those of transformer_jax/tokens.py): the decoder input starts with BOS;
a hypothesis finishes when it emits EOS or reaches its sentence's maximum length `max_len_B` (then it is kept as it
is, without EOS); after that only PAD follows and its score never changes. Lengths |Y| count the emitted tokens,
EOS included. `jax.lax.while_loop` runs the steps and stops as soon as every hypothesis of every sentence has
finished.

Cache stages: a step reads every slot of the self-attention cache and beam search reorders all of them, so their
cost grows with the cache's size, not with the tokens decoded so far. Outputs average ~13 tokens on Multi30k while
the limit (source + 50) reaches 114, so a search with a `grow` function runs in stages of growing cache size (16,
32, 64, ..., max_steps; `cache_stages`), one while_loop each: a stage ends when its slots are full or every
hypothesis has finished, and the next one starts from a cache grown by zero slots. Each stage is compiled once;
the results equal a single loop over max_steps slots (empty slots are never attended).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from transformer_jax.model.transformer import unpacked_segment_ids
from transformer_jax.tokens import BOS_ID, EOS_ID, PAD_ID

Array = jax.Array
PyTree = Any
DecodeStep = Callable[[Array, PyTree], tuple[Array, PyTree]]
GrowCache = Callable[[PyTree, int], PyTree]
NEG_INF = -jnp.inf
FIRST_STAGE = 16  # slots of the first cache stage: most Multi30k outputs (~13 tokens) finish inside it


class Decoder(NamedTuple):
    """A decode step, its initial cache, and `grow(cache, n)` giving the cache room for n steps (None: it has
    room for max_steps already)."""

    step: DecodeStep
    cache: PyTree
    grow: GrowCache | None = None


def cache_stages(max_steps: int) -> list[int]:
    """Cache sizes of the stages: doubling from FIRST_STAGE, then max_steps once doubling would pass 3/4 of it
    (a last stage of a few slots would cost a compilation and save nothing)."""
    stages = [min(FIRST_STAGE, max_steps)]
    while stages[-1] < max_steps:
        doubled = 2 * stages[-1]
        stages.append(doubled if doubled < 0.75 * max_steps else max_steps)
    return stages


def _run_stages(cond: Callable, body: Callable, state: NamedTuple, max_steps: int, grow: GrowCache | None):
    """Runs while_loop(cond, body) over the cache stages (one loop over max_steps slots when grow is None)."""
    if grow is None:
        return jax.lax.while_loop(cond, body, state)
    for slots in cache_stages(max_steps):
        state = state._replace(cache=grow(state.cache, slots))
        state = jax.lax.while_loop(lambda s, slots=slots: cond(s) & (s.step < slots), body, state)
    return state


def length_penalty(length: Array | int, alpha: Array | float) -> Array:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016); beam scores are log P(Y|X) / lp(Y)."""
    return ((5.0 + jnp.asarray(length, jnp.float32)) / 6.0) ** alpha


def tile_beams(tree: PyTree, beam_size: int) -> PyTree:
    """Repeats every non-scalar leaf beam_size times along axis 0: [B, ...] -> [R, ...], beams of a row adjacent."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.repeat(x, beam_size, axis=0), tree)


def gather_rows(tree: PyTree, rows_R: Array) -> PyTree:
    """Reorders every non-scalar leaf along axis 0 (the beam reordering of the cache); scalars stay."""
    return jax.tree.map(lambda x: x if jnp.ndim(x) == 0 else jnp.take(x, rows_R, axis=0), tree)


def _next_log_probs(decode_step: DecodeStep, tokens_R: Array, cache: PyTree) -> tuple[Array, PyTree]:
    logits, cache = decode_step(tokens_R[:, None], cache)
    logits_RV = logits.reshape(tokens_R.shape[0], -1).astype(jnp.float32)
    return jax.nn.log_softmax(logits_RV, axis=-1), cache


def first_argmax(x_BV: Array) -> Array:
    """jnp.argmax over the last axis (the first index of the maximum), as two plain reductions.

    XLA:CPU lowers argmax to a variadic (value, index) reduction that ran 4x slower than a max and a min over
    [64, 8000] (1.16 ms against 0.27 ms; a greedy step takes ~10 ms). A row with a NaN has no index equal to its max
    and gets the last index, where argmax would point at the NaN; either way the output is garbage.
    """
    vocab = x_BV.shape[-1]
    index_BV = jnp.where(x_BV == jnp.max(x_BV, axis=-1, keepdims=True), jnp.arange(vocab, dtype=jnp.int32), vocab)
    return jnp.minimum(jnp.min(index_BV, axis=-1), vocab - 1)


def _write(seq: Array, step: Array, tokens: Array) -> Array:
    """seq[..., step] = tokens (seq [..., L], tokens [...]), with a traced step."""
    return jnp.where(jnp.arange(seq.shape[-1]) == step, tokens[..., None], seq)


class GreedyResult(NamedTuple):
    tokens: Array  # [B, L] int32: the output, EOS included when emitted, PAD after
    log_probs: Array  # [B] float32: log P(tokens | source)
    lengths: Array  # [B] int32: emitted tokens, EOS included


class BeamResult(NamedTuple):
    tokens: Array  # [B, W, L] int32, best beam first; EOS included when emitted, PAD after
    scores: Array  # [B, W] float32: log P / lp(length), descending
    log_probs: Array  # [B, W] float32: log P(tokens | source)
    lengths: Array  # [B, W] int32: emitted tokens, EOS included


def greedy_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    max_steps: int,
    grow: GrowCache | None = None,
) -> GreedyResult:
    """Takes the most probable token at each step. `cache` has B rows; 1 <= max_len_B <= max_steps.

    With `grow` (see Decoder), the cache starts small and grows in stages (module docstring).
    """
    batch = max_len_B.shape[0]

    class State(NamedTuple):
        step: Array
        done_B: Array
        last_B: Array
        tokens_BL: Array
        log_probs_B: Array
        lengths_B: Array
        cache: PyTree

    def cond(s: State) -> Array:
        return (s.step < max_steps) & ~jnp.all(s.done_B)

    def body(s: State) -> State:
        log_probs_BV, cache = _next_log_probs(decode_step, s.last_B, s.cache)
        token_B = first_argmax(log_probs_BV)
        token_B = jnp.where(s.done_B, PAD_ID, token_B)
        gain_B = jnp.take_along_axis(log_probs_BV, token_B[:, None], axis=-1)[:, 0]
        log_probs_B = s.log_probs_B + jnp.where(s.done_B, 0.0, gain_B)
        lengths_B = jnp.where(s.done_B, s.lengths_B, s.step + 1)
        done_B = s.done_B | (token_B == EOS_ID) | (s.step + 1 >= max_len_B)
        return State(s.step + 1, done_B, token_B, _write(s.tokens_BL, s.step, token_B), log_probs_B, lengths_B, cache)

    init = State(
        step=jnp.zeros((), jnp.int32),
        done_B=jnp.zeros((batch,), bool),
        last_B=jnp.full((batch,), BOS_ID, jnp.int32),
        tokens_BL=jnp.full((batch, max_steps), PAD_ID, jnp.int32),
        log_probs_B=jnp.zeros((batch,), jnp.float32),
        lengths_B=jnp.zeros((batch,), jnp.int32),
        cache=cache,
    )
    s = _run_stages(cond, body, init, max_steps, grow)
    return GreedyResult(s.tokens_BL, s.log_probs_B, s.lengths_B)


def beam_search(
    decode_step: DecodeStep,
    cache: PyTree,
    max_len_B: Array,
    *,
    beam_size: int,
    alpha: Array | float,
    max_steps: int,
    grow: GrowCache | None = None,
    best_only: bool = False,
) -> BeamResult:
    """Beam search with the length penalty lp; `cache` has B rows and is tiled to R = B W rows here, once.

    Each step, every unfinished beam proposes its V extensions (score log P / lp(t+1)) and every finished beam
    proposes itself followed by PAD (its score unchanged); the best W of these W V candidates per sentence
    survive, and the cache rows are reordered to follow them. A sentence is done when all W beams have finished,
    so beam_size=1 is exactly greedy search, and a beam large enough to keep every candidate is exhaustive search.
    With `grow` (see Decoder), the cache starts small and grows in stages (module docstring).

    best_only: a sentence also stops once no unfinished beam can overtake its best finished one. log P only falls
    as tokens are added, so an unfinished beam's final score is at most log P / max(lp(t + 1), lp(max_len)); when
    every such bound is below the best finished score, that hypothesis is the search's answer, as it would be after
    running on. The first beam is then exactly the full search's; the others are returned as they stood (an
    unfinished one without EOS). Translation needs only the first beam, and this saves the steps in which the
    worse beams of a finished sentence wander on to its length limit.
    """
    batch, width, max_steps = max_len_B.shape[0], beam_size, int(max_steps)

    class State(NamedTuple):
        step: Array
        finished_BW: Array
        last_BW: Array
        tokens_BWL: Array
        log_probs_BW: Array
        lengths_BW: Array
        cache: PyTree

    def cond(s: State) -> Array:
        return (s.step < max_steps) & ~jnp.all(s.finished_BW)

    def body(s: State) -> State:
        log_probs_RV, cache = _next_log_probs(decode_step, s.last_BW.reshape(-1), s.cache)
        vocab = log_probs_RV.shape[-1]
        log_probs_BWV = log_probs_RV.reshape(batch, width, vocab)
        # Candidate log-probabilities: extensions of unfinished beams; a finished beam only continues with PAD.
        is_pad_V = jnp.arange(vocab) == PAD_ID
        fin_BW1 = s.finished_BW[..., None]
        cand_BWV = jnp.where(
            fin_BW1,
            jnp.where(is_pad_V, s.log_probs_BW[..., None], NEG_INF),
            s.log_probs_BW[..., None] + log_probs_BWV,
        )
        cand_len_BW = jnp.where(s.finished_BW, s.lengths_BW, s.step + 1)
        score_BWV = cand_BWV / length_penalty(cand_len_BW, alpha)[..., None]
        score_BW, flat_BW = jax.lax.top_k(score_BWV.reshape(batch, width * vocab), width)
        beam_BW, token_BW = flat_BW // vocab, (flat_BW % vocab).astype(jnp.int32)

        def pick(x_BW: Array) -> Array:
            return jnp.take_along_axis(x_BW, beam_BW, axis=1)

        was_finished_BW = pick(s.finished_BW)
        log_probs_BW = jnp.take_along_axis(cand_BWV.reshape(batch, -1), flat_BW, axis=1)
        lengths_BW = pick(cand_len_BW)
        tokens_BWL = jnp.take_along_axis(s.tokens_BWL, beam_BW[..., None], axis=1)
        tokens_BWL = _write(tokens_BWL, s.step, token_BW)
        # A beam finishes on EOS, at its sentence's maximum length, or when nothing finite is left (-inf: dead).
        finished_BW = (
            was_finished_BW | (token_BW == EOS_ID) | (s.step + 1 >= max_len_B)[:, None] | (score_BW == NEG_INF)
        )
        if best_only:
            best_finished_B = jnp.max(jnp.where(finished_BW, score_BW, NEG_INF), axis=1)
            lp_max_B = jnp.maximum(length_penalty(s.step + 1, alpha), length_penalty(max_len_B, alpha))
            bound_BW = jnp.where(finished_BW, NEG_INF, log_probs_BW / lp_max_B[:, None])
            settled_B = jnp.max(bound_BW, axis=1) < best_finished_B
            finished_BW = finished_BW | settled_B[:, None]
        rows_R = (jnp.arange(batch)[:, None] * width + beam_BW).reshape(-1)
        return State(
            s.step + 1, finished_BW, token_BW, tokens_BWL, log_probs_BW, lengths_BW, gather_rows(cache, rows_R)
        )

    init = State(
        step=jnp.zeros((), jnp.int32),
        finished_BW=jnp.zeros((batch, width), bool),
        last_BW=jnp.full((batch, width), BOS_ID, jnp.int32),
        tokens_BWL=jnp.full((batch, width, max_steps), PAD_ID, jnp.int32),
        # All W beams start as the same empty prefix; only the first is live, so candidates are not duplicated.
        log_probs_BW=jnp.tile(jnp.array([0.0] + [NEG_INF] * (width - 1), jnp.float32), (batch, 1)),
        lengths_BW=jnp.zeros((batch, width), jnp.int32),
        cache=tile_beams(cache, width),
    )
    s = _run_stages(cond, body, init, max_steps, grow)
    scores_BW = s.log_probs_BW / length_penalty(s.lengths_BW, alpha)
    scores_BW, order_BW = jax.lax.top_k(scores_BW, width)  # already sorted unless stopped early; cheap to be sure

    def sort(x: Array) -> Array:
        idx = order_BW.reshape(order_BW.shape + (1,) * (x.ndim - 2))
        return jnp.take_along_axis(x, idx, axis=1)

    return BeamResult(sort(s.tokens_BWL), scores_BW, sort(s.log_probs_BW), sort(s.lengths_BW))


# -- the Transformer behind the decode-step interface ------------------------------------------------------------


def cached_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder over `model.decode` with a KV cache that grows in stages; for use inside a traced function.

    The cross-attention keys/values are projected once per sentence (`init_cache`) and tiled over the beams once;
    they are the same for every beam of a sentence, so they are closed over instead of being carried through the
    loop and reordered each step. The returned cache holds what changes per step: the write index and the
    self-attention keys/values, with B rows (the search tiles them), and room for the first stage's steps.
    """
    full = model.init_cache(memory_BSD, src_segment_ids_BS, cache_stages(max_steps)[0])
    static = tile_beams({"src_segment_ids": full["src_segment_ids"], "cross": full["cross"]}, beam_size)
    cache = {"index": full["index"], "self": full["self"]}

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        logits_R1V, new = model.decode(None, tokens_R1, cache={**static, **cache})
        return logits_R1V, {"index": new["index"], "self": new["self"]}

    def grow(cache: PyTree, slots: int) -> PyTree:
        return model.grow_cache(cache, slots)

    return Decoder(decode_step, cache, grow)


def recompute_decode_step(
    model: nnx.Module, memory_BSD: Array, src_segment_ids_BS: Array, *, beam_size: int, max_steps: int
) -> Decoder:
    """A Decoder without a KV cache: each step runs `model.decode` on the whole target prefix again.

    The cache is only the token buffer [B, max_steps] and its write index; positions after the index are hidden by
    the causal mask, so the logits at the index are those of the prefix. Used as the reference and the benchmark
    baseline of the cached step.
    """
    memory_RSD, src_seg_RS = tile_beams((memory_BSD, src_segment_ids_BS), beam_size)
    batch = memory_BSD.shape[0]
    cache = {"index": jnp.zeros((), jnp.int32), "tokens": jnp.zeros((batch, max_steps), jnp.int32)}

    def decode_step(tokens_R1: Array, cache: PyTree) -> tuple[Array, PyTree]:
        index = cache["index"]
        tokens_RL = jax.lax.dynamic_update_slice_in_dim(cache["tokens"], tokens_R1, index, axis=1)
        # Every slot is a real target position here (even a generated PAD), so the segment ids are all ones.
        logits_RLV = model.decode(
            memory_RSD, tokens_RL, src_segment_ids=src_seg_RS, tgt_segment_ids=jnp.ones_like(tokens_RL)
        )
        logits_R1V = jax.lax.dynamic_slice_in_dim(logits_RLV, index, 1, axis=1)
        return logits_R1V, {"index": index + 1, "tokens": tokens_RL}

    return Decoder(decode_step, cache)


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "max_steps", "use_cache"))
def _search(
    graphdef: nnx.GraphDef,
    state: nnx.State,
    src_BS: Array,
    max_len_B: Array,
    alpha: Array,
    *,
    beam_size: int,
    max_steps: int,
    use_cache: bool,
) -> BeamResult:
    model = nnx.merge(graphdef, state)
    src_segment_ids_BS = unpacked_segment_ids(src_BS)
    memory_BSD = model.encode(src_BS, src_segment_ids_BS)
    make = cached_decode_step if use_cache else recompute_decode_step
    d = make(model, memory_BSD, src_segment_ids_BS, beam_size=beam_size, max_steps=max_steps)
    if beam_size == 1:
        g = greedy_search(d.step, d.cache, max_len_B, max_steps=max_steps, grow=d.grow)
        scores_B1 = (g.log_probs / length_penalty(g.lengths, alpha))[:, None]
        return BeamResult(g.tokens[:, None], scores_B1, g.log_probs[:, None], g.lengths[:, None])
    return beam_search(
        d.step, d.cache, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps, grow=d.grow, best_only=True
    )


Search = Callable[..., BeamResult]


def searcher(model: nnx.Module, *, use_cache: bool = True) -> Search:
    """`search` bound to the model's parameters as they are now: split once, then one jitted call per batch.

    nnx.split walks the whole module graph (~0.2 s for the 3+3-layer model on a 2-core CPU); translating many
    batches with `search` would pay that per batch, so translate() makes one searcher per call. Runs the model in
    eval mode (dropout off) without changing the caller's model; later changes to the model's parameters are not
    seen.
    """
    graphdef, state = nnx.split(model)
    # Key the compilation on the eval-mode graph, so a model in train mode (validation during training) and the
    # same model in eval mode share one compiled search. The copy shares the arrays; the caller's model is unchanged.
    copy = nnx.merge(graphdef, state)
    copy.eval()
    graphdef, state = nnx.split(copy)

    def run(src_BS: Array, max_len_B: Array, *, beam_size: int, alpha: float, max_steps: int) -> BeamResult:
        return _search(
            graphdef,
            state,
            jnp.asarray(src_BS, jnp.int32),
            jnp.asarray(max_len_B, jnp.int32),
            jnp.asarray(alpha, jnp.float32),
            beam_size=beam_size,
            max_steps=max_steps,
            use_cache=use_cache,
        )

    return run


def search(
    model: nnx.Module,
    src_BS: Array,
    max_len_B: Array,
    *,
    beam_size: int,
    alpha: float,
    max_steps: int,
    use_cache: bool = True,
) -> BeamResult:
    """Encodes src [B, S] (PAD-padded, EOS-terminated) and searches, jitted; beam_size 1 runs greedy search.

    Compiles once per (graph, shapes, beam_size, max_steps); alpha is traced, so changing it does not recompile.
    Runs the model in eval mode (dropout off) without changing the caller's model. For many batches of one model,
    use `searcher`. A sentence stops once its best hypothesis is settled (beam_search's best_only): the first beam
    is the full search's; the others are as they stood then.
    """
    return searcher(model, use_cache=use_cache)(
        src_BS, max_len_B, beam_size=beam_size, alpha=alpha, max_steps=max_steps
    )
