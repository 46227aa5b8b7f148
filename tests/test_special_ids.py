"""Reserved ids as a property of the vocabulary (model.layers.SpecialIds, model.*_id): a model with Marian's ids (eos 0,
unk 1, pad = bos = V - 1, so its decoder starts from pad) batches, trains and decodes as one with the default ids."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from tests.helpers.model import forward, tiny_model
from tests.helpers.training import one_layer_config
from transformer_jax import decoding
from transformer_jax.data import batching
from transformer_jax.model.layers import SpecialIds
from transformer_jax.sharding import make_mesh
from transformer_jax.training.step import compile_steps, create_train_state, cross_entropy_sums

VOCAB = 50
MARIAN = SpecialIds(pad=VOCAB - 1, eos=0, bos=VOCAB - 1, unk=1)
MARIAN_KEYS = {"pad_id": MARIAN.pad, "eos_id": MARIAN.eos, "bos_id": MARIAN.bos, "unk_id": MARIAN.unk}


def _pairs(seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    """Random sentences of ids in [2, V - 1): no reserved id of MARIAN."""
    rng = np.random.default_rng(seed)
    src = [rng.integers(2, VOCAB - 1, k).tolist() for k in rng.integers(2, 8, n)]
    tgt = [rng.integers(2, VOCAB - 1, k).tolist() for k in rng.integers(2, 8, n)]
    return src, tgt


def _batch(seed: int, rows: int = 8, length: int = 10) -> dict[str, np.ndarray]:
    """A padded batch of the data contract, made by the data path with MARIAN's ids."""
    examples = batching.from_ids(*_pairs(seed, rows), length, eos=MARIAN.eos)
    return batching.assemble(examples, batching.one_per_row(np.arange(rows), (rows, length, length)), MARIAN)


def test_batches_pad_with_the_vocabularys_pad_and_start_the_target_from_its_bos():
    batch = _batch(0)
    real_src, real_tgt = batch["src_segment_ids"] > 0, batch["tgt_segment_ids"] > 0
    assert np.all(batch["src_tokens"][~real_src] == MARIAN.pad)
    assert np.all(batch["tgt_in"][~real_tgt] == MARIAN.pad) and np.all(batch["tgt_out"][~real_tgt] == MARIAN.pad)
    assert np.all(batch["tgt_in"][:, 0] == MARIAN.bos) and np.all(real_tgt[:, 0])  # bos is pad, and real
    lengths = real_tgt.sum(1)
    assert np.all(batch["tgt_out"][np.arange(8), lengths - 1] == MARIAN.eos)
    assert np.all(batch["src_tokens"][np.arange(8), real_src.sum(1) - 1] == MARIAN.eos)


def test_the_decoders_first_input_is_real_although_it_is_the_pad_id():
    """Segment ids derived from the tokens (decode without them, as scoring, explain and the search's recompute path
    do) equal the batch's: the first decoder input, bos = pad, is not taken for padding."""
    model = tiny_model(3, **MARIAN_KEYS)
    batch = {k: jnp.asarray(v) for k, v in _batch(1).items()}
    given = forward(
        model,
        batch["src_tokens"],
        batch["tgt_in"],
        src_segment_ids=batch["src_segment_ids"],
        tgt_segment_ids=batch["tgt_segment_ids"],
    )
    derived = forward(model, batch["src_tokens"], batch["tgt_in"])
    real = np.asarray(batch["tgt_segment_ids"]) > 0
    np.testing.assert_allclose(np.asarray(derived)[real], np.asarray(given)[real], rtol=1e-5, atol=1e-5)


def test_the_loss_ignores_padding():
    """Each row alone, cut to its own length (no padding at all), sums to the batch's loss. (Three rows: every row
    alone is a shape of its own, so a program of its own.)"""
    model = tiny_model(4, **MARIAN_KEYS)
    batch = {k: jnp.asarray(v) for k, v in _batch(2, rows=3).items()}
    logits = forward(
        model,
        batch["src_tokens"],
        batch["tgt_in"],
        src_segment_ids=batch["src_segment_ids"],
        tgt_segment_ids=batch["tgt_segment_ids"],
    )
    real = batch["tgt_segment_ids"] > 0
    whole = float(cross_entropy_sums(logits, batch["tgt_out"], real, 0.1, fused_backward=False)["loss_sum"])
    rows = 0.0
    for r in range(3):
        s, t = int(batch["src_segment_ids"][r].sum()), int(batch["tgt_segment_ids"][r].sum())
        alone = forward(model, batch["src_tokens"][r : r + 1, :s], batch["tgt_in"][r : r + 1, :t])
        sums = cross_entropy_sums(alone, batch["tgt_out"][r : r + 1, :t], jnp.ones((1, t)), 0.1, fused_backward=False)
        rows += float(sums["loss_sum"])
    np.testing.assert_allclose(whole, rows, rtol=1e-4)


def test_a_model_with_marian_ids_trains():
    config = one_layer_config(dropout_rate=0.0, **MARIAN_KEYS)
    graphs, state = create_train_state(config)
    step, _, _ = compile_steps(graphs, state, make_mesh(), "data", label_smoothing=0.1, accum_steps=1)
    batch = {k: jnp.asarray(v) for k, v in _batch(3).items()}
    losses = []
    for _ in range(6):
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    assert np.all(np.isfinite(losses)) and losses[-1] < losses[0]


def _decoder_input(prefix: list[int], width: int) -> jnp.ndarray:
    """[[bos, *prefix]] filled up to `width` with a real token: the decoder is causal, so what follows position
    len(prefix) never changes its logits, and every call has one shape (one compiled program)."""
    return jnp.asarray([[MARIAN.bos, *prefix] + [2] * (width - 1 - len(prefix))])


def _reference_greedy(model, src: list[int], limit: int) -> list[int]:
    """Greedy decoding by full recomputation, the decoder fed from bos = pad: argmax of each step's logits without
    pad, until eos or the limit."""
    out: list[int] = []
    src_1S = jnp.asarray([src + [MARIAN.pad] * (8 - len(src))])
    while len(out) < limit and (not out or out[-1] != MARIAN.eos):
        logits_V = np.array(forward(model, src_1S, _decoder_input(out, limit))[0, len(out)])
        logits_V[MARIAN.pad] = -np.inf
        out.append(int(np.argmax(logits_V)))
    return out


def _marian_model_that_often_ends_and_prefers_pad():
    """A tiny model with MARIAN's ids whose logits make eos likely and pad the argmax wherever token k, the one its
    outputs emit most, was: an untied output projection whose eos and pad columns are k's, scaled."""
    model = tiny_model(5, tie_output=False, **MARIAN_KEYS)
    sources = [s + [MARIAN.eos] for s in _pairs(6, 4)[0]]
    emitted = [t for s in sources for t in _reference_greedy(model, s, 4)]
    k = int(np.bincount(emitted).argmax())
    kernel = model.output_proj.kernel
    kernel[...] = (
        kernel[...].at[:, MARIAN.eos].set(1.05 * kernel[...][:, k]).at[:, MARIAN.pad].set(1.2 * kernel[...][:, k])
    )
    return model, sources


def test_greedy_and_beam_search_stop_at_the_vocabularys_eos_and_never_emit_pad():
    model, sources = _marian_model_that_often_ends_and_prefers_pad()
    limit = 6
    search = decoding.Searcher(model)
    found = search.sentences(
        sources, [limit] * len(sources), decoding.Greedy(alpha=0.6), batch_size=4, shape=lambda _: (8, limit)
    )
    greedy = [[int(t) for t in r.tokens[0, : int(r.lengths[0])]] for r in found]
    assert greedy == [_reference_greedy(model, s, limit) for s in sources]
    assert any(out[-1] == MARIAN.eos and len(out) < limit for out in greedy), "some output must end with eos"
    beams = search.sentences(
        sources,
        [limit] * len(sources),
        decoding.Beam(alpha=0.6, beam_size=3, settle=0),
        batch_size=4,
        shape=lambda _: (8, limit),
    )
    for src, r in zip(sources, beams, strict=True):
        for w in range(3):
            out = [int(t) for t in r.tokens[w, : int(r.lengths[w])]]
            assert MARIAN.pad not in out and MARIAN.eos not in out[:-1]
            assert out[-1] == MARIAN.eos or len(out) == limit
            # Its log P is the teacher-forced one, normalised over the whole vocabulary (pad included).
            src_1S = jnp.asarray([src + [MARIAN.pad] * (8 - len(src))])
            log_probs = jax.nn.log_softmax(forward(model, src_1S, _decoder_input(out[:-1], limit))[0], -1)
            np.testing.assert_allclose(
                r.log_probs[w], np.sum(np.asarray(log_probs)[np.arange(len(out)), out]), rtol=1e-4, atol=1e-4
            )
