"""The search protocol (decoding/specs.py): a search defined here, and nowhere in the package, runs through the
Searcher and the refilling scheduler on the tiny model and gives what a direct computation gives."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.helpers.decoding import BOS, EOS, IDS, PAD, log_softmax, reference_lp, shared_model
from tests.helpers.model import forward
from transformer_jax import decoding

BANNED = (PAD, BOS, IDS.unk)  # reserved ids the toy search never emits (a generated PAD would read as padding)


def _second_best(logits_BV: jax.Array, step_B: jax.Array) -> jax.Array:
    allowed_BV = logits_BV.at[:, list(BANNED)].set(-jnp.inf)
    return jax.lax.top_k(allowed_BV, 2)[1][:, 1]


@decoding.search_spec("alpha")
class SecondBest(decoding.Search):
    """Each step emits the second most probable token but for the reserved ones (Search's one-row state, start and
    scores)."""

    def advance(self, s, step, max_len_B, row_inputs, reorder):
        return s.advance(step, max_len_B, None, _second_best, ids=self.reserved)


def _sources(n: int) -> list[list[int]]:
    rng = np.random.default_rng(11)
    return [[int(t) for t in rng.integers(4, 50, k - 1)] + [EOS] for k in rng.integers(2, 12, n)]


def _padded(sources: list[list[int]]) -> np.ndarray:
    src_NS = np.full((len(sources), 16), PAD, np.int32)
    for i, ids in enumerate(sources):
        src_NS[i, : len(ids)] = ids
    return src_NS


def _second_best_directly(model, sources: list[list[int]], max_len: list[int], slots: int):
    """(tokens, log P) of each sentence, step by step from the teacher-forced logits of its prefix (no cache)."""
    src_NS = _padded(sources)
    outputs, log_probs, done = [[] for _ in sources], np.zeros(len(sources)), np.zeros(len(sources), bool)
    for t in range(max(max_len)):
        tgt_NT = np.full((len(sources), slots), PAD, np.int32)
        tgt_NT[:, 0] = BOS
        for i, out in enumerate(outputs):
            tgt_NT[i, 1 : 1 + len(out)] = out
        # Padded to fixed lengths (one compilation); causality hides the padding after position t.
        logits_NV = np.asarray(forward(model, jnp.asarray(src_NS), jnp.asarray(tgt_NT))[:, t], np.float64)
        for i in np.flatnonzero(~done):
            allowed = np.where(np.isin(np.arange(logits_NV.shape[1]), BANNED), -np.inf, logits_NV[i])
            token = int(np.argsort(-allowed, kind="stable")[1])
            outputs[i].append(token)
            log_probs[i] += log_softmax(logits_NV[i])[token]
            done[i] = token == EOS or len(outputs[i]) == max_len[i]
    return outputs, log_probs


def _first_logits(model, sources: list[list[int]], slots: int) -> np.ndarray:
    """Each sentence's logits at the first output step (teacher-forced BOS)."""
    src_NS = _padded(sources)
    tgt_NT = np.full((len(sources), slots), PAD, np.int32)
    tgt_NT[:, 0] = BOS
    return np.asarray(forward(model, jnp.asarray(src_NS), jnp.asarray(tgt_NT))[:, 0], np.float64)


# the refilling scheduler; one-jit batches (slow: the protocol is the same, the scheduler is tested elsewhere)
@pytest.mark.parametrize("compact", [True, pytest.param(False, marks=pytest.mark.slow)])
def test_a_search_defined_in_a_test_runs_through_the_scheduler(compact):
    model, sources = shared_model(), _sources(20)
    max_len = [2 + i % 7 for i in range(len(sources))]
    search = SecondBest(alpha=0.6)
    searcher = decoding.Searcher(model, compact=compact)
    assert searcher.refills(16) == compact  # 20 sentences in a batch of 16: the refilling path when compacting
    found = searcher.sentences(sources, max_len, search, batch_size=16, shape=lambda _: (16, 9))
    outputs, log_probs = _second_best_directly(model, sources, max_len, 9)
    for r, out, log_p in zip(found, outputs, log_probs, strict=True):
        n = int(r.lengths[0])
        assert [int(t) for t in r.tokens[0, :n]] == out
        assert np.all(r.tokens[0, n:] == PAD)
        np.testing.assert_allclose(r.log_probs[0], log_p, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(r.scores[0], r.log_probs[0] / reference_lp(n, 0.6, "gnmt"), rtol=1e-6)
    # Not greedy search: greedy's first token is each sentence's most probable one, the toy search's is not.
    greedy = searcher.sentences(sources, max_len, decoding.Greedy(alpha=0.6), batch_size=16, shape=lambda _: (16, 9))
    first = _first_logits(model, sources, 9)
    for i, (g, r) in enumerate(zip(greedy, found, strict=True)):
        ranked = np.argsort(-first[i], kind="stable")
        near_tie = first[i][ranked[0]] - first[i][ranked[1]] < 1e-4  # either program's rounding may break it
        assert first[i][int(g.tokens[0, 0])] >= first[i][ranked[0]] - 1e-4, (i, int(g.tokens[0, 0]), ranked[:3])
        assert int(r.tokens[0, 0]) != int(g.tokens[0, 0]) or near_tie, (i, int(r.tokens[0, 0]), ranked[:3])


def test_a_spec_is_a_static_structure_with_alpha_traced():
    """One program serves every alpha (a leaf), and the specs differ as jit keys by their static fields."""
    beam = decoding.Beam(alpha=0.6, beam_size=4)
    assert jax.tree.leaves(beam) == [0.6]
    assert jax.tree.structure(beam) == jax.tree.structure(decoding.Beam(alpha=1.0, beam_size=4))
    assert jax.tree.structure(beam) != jax.tree.structure(decoding.Beam(alpha=0.6, beam_size=4, settle=2))
    assert hash(beam) == hash(decoding.Beam(alpha=0.6, beam_size=4))
    with pytest.raises(TypeError, match="beam_size"):
        decoding.Beam(alpha=0.6)  # the number of beams has no default


def test_specs_of_two_kinds_are_two_jit_keys_whatever_their_fields():
    """Beam(settle=2) and SetAside(hypotheses=2) hold the same values, as do Greedy and a search defined elsewhere:
    their treedefs differ by kind. jaxlib's register_dataclass treedefs compared equal here, and jit then ran the
    in-beam search's program for a set-aside search whenever the two keys' hashes met in its cache (a test of
    evaluate.py's --finished failed about once in ten runs)."""
    beam = decoding.Beam(alpha=1.0, penalty="average", beam_size=2).nbest(2)
    aside = decoding.SetAside(alpha=1.0, penalty="average", beam_size=2).nbest(2)
    greedy, second = decoding.Greedy(alpha=0.6), SecondBest(alpha=0.6)
    for a, b in [(beam, aside), (greedy, second), (greedy, decoding.Search(alpha=0.6))]:
        assert jax.tree.leaves(a) == jax.tree.leaves(b)
        assert jax.tree.structure(a) != jax.tree.structure(b), (a, b)
    # The structure rebuilds the spec of its kind, with its static fields, around new leaves (no __init__ checks).
    rebuilt = jax.tree.unflatten(jax.tree.structure(aside), [0.5])
    assert type(rebuilt) is decoding.SetAside and rebuilt == decoding.SetAside(
        alpha=0.5, penalty="average", beam_size=2, hypotheses=2
    )
    assert [str(path) for path, _ in jax.tree_util.tree_flatten_with_path(aside)[0]] == ["(GetAttrKey(name='alpha'),)"]
    assert jax.tree.map(lambda x: x, decoding.Sampled(alpha=0.6, sampling=decoding.Sampling(1.0, 0, 1.0), seed=3)) == (
        decoding.Sampled(alpha=0.6, sampling=decoding.Sampling(1.0, 0, 1.0), seed=3)
    )

    @jax.jit
    def kind(spec):
        return spec.alpha * (2.0 if isinstance(spec, decoding.SetAside) else 1.0)

    assert (float(kind(beam)), float(kind(aside))) == (1.0, 2.0)


def test_search_for_maps_evaluate_flags_to_one_spec_each():
    sampling = decoding.Sampling(1.0, 0, 1.0)
    assert decoding.search_for(1, 0.6) == decoding.Greedy(alpha=0.6)
    assert decoding.search_for(1, 0.6, finished="set_aside") == decoding.Greedy(alpha=0.6)  # one beam: nothing aside
    assert decoding.search_for(4, 0.6, "average") == decoding.Beam(alpha=0.6, penalty="average", beam_size=4)
    assert decoding.search_for(4, 0.6, finished="set_aside") == decoding.SetAside(alpha=0.6, beam_size=4)
    assert decoding.search_for(1, 0.6, sampling=sampling, seed=3) == decoding.Sampled(
        alpha=0.6, sampling=sampling, seed=3
    )
    with pytest.raises(ValueError, match="beam_size must be 1"):
        decoding.search_for(2, 0.6, sampling=sampling)
    with pytest.raises(ValueError, match="needs the per-row inputs"):  # a sampled search without its keys
        decoding.Searcher(shared_model()).sentences(
            [[5, EOS]], [3], decoding.search_for(1, 0.6, sampling=sampling), batch_size=8, shape=lambda _: (8, 3)
        )
