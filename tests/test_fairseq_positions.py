"""What M2M-100 and NLLB-200 need of the model: fairseq's sinusoids (model.sinusoid_layout=fairseq), positions
shifted by model.position_offset (fairseq's start at padding_idx + 1 = 2), and a decoder that starts from `</s>`
(bos_id == eos_id). Checked against transformers' M2M100SinusoidalPositionalEmbedding, against the same model given
hand-shifted positions, and against a greedy loop over full forward passes; the exports refuse what they cannot
hold, and configs saved before the keys load as the models they were."""

from __future__ import annotations

import copy
import json
import re

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest

from configs import common
from tests.helpers.model import call, forward, tiny_model, tiny_spec
from tests.helpers.training import write_corpus
from transformer_jax import cli, decoding
from transformer_jax.config import schema
from transformer_jax.data import batching
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.evaluation.scoring import score_pairs
from transformer_jax.evaluation.translate import input_limit, position_limit
from transformer_jax.interop import marian
from transformer_jax.model.layers import SpecialIds, TransformerSpec, sinusoidal_encoding
from transformer_jax.training import bookkeeping, checkpoints

OFFSET = 2  # fairseq's padding_idx (1) + 1
FAIRSEQ = dict(sinusoid_layout="fairseq", position_offset=OFFSET)
# fairseq's dictionary: <s> 0, <pad> 1, </s> 2, <unk> 3; decoding starts from </s>.
FAIRSEQ_IDS = SpecialIds(pad=1, eos=2, bos=2, unk=3)
FAIRSEQ_KEYS = {"pad_id": 1, "eos_id": 2, "bos_id": 2, "unk_id": 3}


def transformers_m2m100():
    pytest.importorskip("torch", reason="torch is not installed: the reference needs it")
    return pytest.importorskip("transformers.models.m2m_100.modeling_m2m_100")


# -- fairseq's sinusoids -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("d_model", [4, 8, 32, 512, 1024])
def test_fairseq_sinusoids_equal_transformers_m2m100_table_at_the_shifted_positions(d_model):
    torch = pytest.importorskip("torch")
    m2m = transformers_m2m100()
    positions = 300
    theirs = m2m.M2M100SinusoidalPositionalEmbedding.get_embedding(positions + OFFSET, d_model).numpy()
    ours = np.asarray(sinusoidal_encoding(jnp.arange(positions)[None] + OFFSET, d_model, "fairseq")[0])
    # torch's and XLA's float32 exp may differ in the last bit of a frequency, which 300 positions multiply (sin's
    # argument then differs by up to ~3e-5); everything else agrees to float32 rounding.
    np.testing.assert_allclose(ours, theirs[OFFSET:], atol=1e-4, rtol=0)
    # The module itself, as M2M-100's encoder calls it: token i of a row without padding reads position i + 2.
    module = m2m.M2M100SinusoidalPositionalEmbedding(positions, d_model, padding_idx=1)
    input_ids = torch.full((2, 40), 5, dtype=torch.long)
    np.testing.assert_allclose(module(input_ids)[0].numpy(), ours[:40], atol=1e-4, rtol=0)


def test_fairseq_frequencies_run_from_1_to_exactly_1_over_10000():
    """exp(-ln(10000) i / (d/2 - 1)): the first frequency 1, the last 1/10000 (d/2 - 1 in the denominator; the
    paper's and Marian's d/2 stop one step short of it)."""
    d = 16
    angles = np.arcsin(np.asarray(sinusoidal_encoding(jnp.asarray([[1]]), d, "fairseq")[0, 0, : d // 2]))
    np.testing.assert_allclose(angles, np.exp(-np.log(10000.0) * np.arange(d // 2) / (d // 2 - 1)), rtol=1e-5)
    marian_angles = np.arcsin(np.asarray(sinusoidal_encoding(jnp.asarray([[1]]), d, "concatenated")[0, 0, : d // 2]))
    assert marian_angles[-1] == pytest.approx(10000 ** (-(d - 2) / d), rel=1e-5)


def test_the_concatenated_layout_is_marians():
    pytest.importorskip("torch")
    marian_module = pytest.importorskip("transformers.models.marian.modeling_marian")
    theirs = marian_module.MarianSinusoidalPositionalEmbedding(64, 32).create_weight().numpy()
    ours = np.asarray(sinusoidal_encoding(jnp.arange(64)[None], 32, "concatenated")[0])
    np.testing.assert_allclose(ours, theirs, atol=2e-6, rtol=0)


def test_fairseq_layout_needs_d_model_of_at_least_4():
    with pytest.raises(ConfigError, match="^config key model.sinusoid_layout: fairseq's frequencies need d_model >= 4"):
        tiny_spec(d_model=2, num_heads=1, **FAIRSEQ)


# -- the offset --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("positional", ["sinusoidal", "learned"])
def test_the_offset_shifts_every_position_the_encoding_reads(positional):
    """A model with the offset computes what the same parameters compute given positions shifted by hand, on both
    sides; and the offset matters (the outputs without it differ)."""
    extra = dict(positional=positional, max_len=16) if positional == "learned" else {}
    shifted = tiny_model(3, **FAIRSEQ, **extra)
    plain = tiny_model(3, sinusoid_layout="fairseq", **extra)  # the same parameters: the offset adds none
    src = jnp.asarray([[5, 6, 7, 8, 9, 2, 1, 1], [10, 11, 12, 13, 14, 15, 16, 2]], jnp.int32)
    tgt = jnp.asarray([[2, 20, 21, 22, 1, 1], [2, 23, 24, 25, 26, 27]], jnp.int32)
    kwargs = dict(src_segment_ids=(src != 1).astype(jnp.int32), tgt_segment_ids=(tgt != 1).at[:, 0].set(True))
    kwargs["tgt_segment_ids"] = kwargs["tgt_segment_ids"].astype(jnp.int32)
    by_hand = dict(src_positions=jnp.broadcast_to(jnp.arange(8) + OFFSET, (2, 8)))
    by_hand["tgt_positions"] = jnp.broadcast_to(jnp.arange(6) + OFFSET, (2, 6))
    memory = call(shifted, "encode", src, kwargs["src_segment_ids"])
    memory_by_hand = call(plain, "encode", src, kwargs["src_segment_ids"], by_hand["src_positions"])
    np.testing.assert_allclose(np.asarray(memory), np.asarray(memory_by_hand), atol=1e-6, rtol=0)
    logits = forward(shifted, src, tgt, **kwargs)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(forward(plain, src, tgt, **kwargs, **by_hand)), atol=1e-5)
    assert np.abs(np.asarray(logits) - np.asarray(forward(plain, src, tgt, **kwargs))).max() > 1e-3


def test_cached_decoding_equals_full_decoding_with_the_offset():
    model = tiny_model(4, **FAIRSEQ, **FAIRSEQ_KEYS)
    src = jnp.asarray([[5, 6, 7, 8, 2, 1], [9, 10, 11, 12, 13, 2]], jnp.int32)
    tgt = jnp.asarray([[2, 20, 21, 22, 23, 24, 25], [2, 26, 27, 28, 29, 30, 31]], jnp.int32)
    full = np.asarray(forward(model, src, tgt))
    memory = call(model, "encode", src)
    cache = call(model, "init_cache", memory, None, max_len=4, src_tokens=src)
    steps = []
    for t in range(tgt.shape[1]):
        if t == 4:  # the decoding stages grow the cache: positions go on from where they were
            cache = call(model, "grow_cache", cache, max_len=8)
        logits, cache = call(model, "decode", None, tgt[:, t : t + 1], cache=cache)
        steps.append(np.asarray(logits)[:, 0])
    np.testing.assert_allclose(np.stack(steps, 1), full, atol=1e-5, rtol=0)


def test_a_learned_table_holds_max_len_less_the_offset_positions():
    spec = tiny_spec(positional="learned", max_len=10, position_offset=OFFSET)
    assert position_limit(spec) == 8 and input_limit(256, position_limit(spec)) == 8
    model = tiny_model(0, positional="learned", max_len=10, position_offset=OFFSET)
    call(model, "encode", jnp.full((1, 8), 5, jnp.int32))  # rows 2 .. 9: the last row
    with pytest.raises(ValueError, match="sequence of 9 tokens from model.position_offset=2 exceeds model.max_len=10"):
        model.encode(jnp.full((1, 9), 5, jnp.int32))
    memory = call(model, "encode", jnp.full((1, 4), 5, jnp.int32))
    with pytest.raises(ValueError, match="decoding 9 tokens from model.position_offset=2 exceeds model.max_len=10"):
        model.init_cache(memory, None, 9, src_tokens=jnp.full((1, 4), 5, jnp.int32))
    with pytest.raises(ConfigError, match="^config key model.position_offset: 10 leaves none of the 10 rows"):
        tiny_spec(positional="learned", max_len=10, position_offset=10)
    config = common.base_config("tiny")
    config.model.update(positional="learned", max_len=66, position_offset=OFFSET)
    config.data.max_len = 64
    cli.validate(config)  # 64 positions from 2 on: rows 2 .. 65
    config.model.max_len = 65
    with pytest.raises(ConfigError, match=r"^config key data.max_len: 64 tokens per side exceed the 63 positions"):
        cli.validate(config)


# -- bos == eos --------------------------------------------------------------------------------------------------


def fairseq_model(seed: int = 5):
    """A tiny model with fairseq's ids, sinusoids and offset, whose EOS (also its first decoder input) is made likely:
    with tied embeddings, EOS's row is 1.1 x that of token k, the one its outputs emit most, so that some outputs end
    early and others run into their limit."""
    model = tiny_model(seed, num_encoder_layers=1, num_decoder_layers=1, **FAIRSEQ, **FAIRSEQ_KEYS)
    sources = _sources(20)
    emitted = [t for s in sources[:4] for t in reference_greedy(model, s, 4)]
    k = int(np.bincount(emitted).argmax())
    table = model.src_embed.table_VD
    table[...] = table[...].at[FAIRSEQ_IDS.eos].set(1.1 * table[...][k])
    return model, sources


def _sources(n: int) -> list[list[int]]:
    rng = np.random.default_rng(8)
    return [rng.integers(4, 50, k).tolist() + [FAIRSEQ_IDS.eos] for k in rng.integers(1, 8, n)]


def _decoder_input(prefix: list[int], width: int) -> jnp.ndarray:
    """[[bos, *prefix]] filled up to `width` with a real token (the decoder is causal: one shape, one program)."""
    return jnp.asarray([[FAIRSEQ_IDS.bos, *prefix] + [5] * (width - 1 - len(prefix))])


def reference_greedy(model, src: list[int], limit: int) -> list[int]:
    """Greedy decoding by full recomputation from bos = eos: the argmax of each step's logits without pad, until an
    emitted eos or the limit (the first input, eos itself, ends nothing)."""
    out: list[int] = []
    src_1S = jnp.asarray([src + [FAIRSEQ_IDS.pad] * (8 - len(src))])
    while len(out) < limit and (not out or out[-1] != FAIRSEQ_IDS.eos):
        logits_V = np.array(forward(model, src_1S, _decoder_input(out, limit))[0, len(out)])
        logits_V[FAIRSEQ_IDS.pad] = -np.inf
        out.append(int(np.argmax(logits_V)))
    return out


def test_greedy_search_from_eos_equals_a_loop_over_full_forward_passes_through_the_refilling_scheduler():
    model, sources = fairseq_model()
    limit = 6
    search = decoding.Searcher(model)
    assert search.refills(decoding.batch_rows(len(sources), 16))  # finished sentences leave, waiting ones join
    found = search.sentences(
        sources, [limit] * len(sources), decoding.Greedy(alpha=0.6), batch_size=16, shape=lambda _: (8, limit)
    )
    greedy = [[int(t) for t in r.tokens[0, : int(r.lengths[0])]] for r in found]
    assert greedy == [reference_greedy(model, s, limit) for s in sources]
    assert any(out[-1] == FAIRSEQ_IDS.eos and len(out) < limit for out in greedy), "some output must end with eos"
    assert any(FAIRSEQ_IDS.eos not in out for out in greedy), "some output must run into its limit"
    # Its log P is the teacher-forced one from bos = eos.
    for src, r in zip(sources[:4], found[:4], strict=True):
        out = greedy[sources.index(src)]
        src_1S = jnp.asarray([src + [FAIRSEQ_IDS.pad] * (8 - len(src))])
        log_probs = jax.nn.log_softmax(forward(model, src_1S, _decoder_input(out[:-1], limit))[0], -1)
        expected = np.sum(np.asarray(log_probs)[np.arange(len(out)), out])
        np.testing.assert_allclose(r.log_probs[0], expected, rtol=1e-4, atol=1e-4)


def test_the_same_model_with_a_distinct_bos_whose_row_is_eos_decodes_the_same():
    """bos == eos is only the first input: a copy whose bos is another id with EOS's embedding row emits the same
    greedy tokens (the copy's bos row also ties EOS's logit, and the search takes the lower id, EOS)."""
    model, sources = fairseq_model()
    keys = {**FAIRSEQ_KEYS, "bos_id": 4}
    distinct = tiny_model(5, num_encoder_layers=1, num_decoder_layers=1, **FAIRSEQ, **keys)
    table = model.src_embed.table_VD[...]
    distinct.src_embed.table_VD[...] = table.at[4].set(table[FAIRSEQ_IDS.eos])
    limit = 6

    def tokens(m):
        found = decoding.Searcher(m).sentences(
            sources[:8], [limit] * 8, decoding.Greedy(alpha=0.6), batch_size=8, shape=lambda _: (8, limit)
        )
        return [[int(t) for t in r.tokens[0, : int(r.lengths[0])]] for r in found]

    assert tokens(distinct) == tokens(model)


def test_beam_search_from_eos_ends_only_on_an_emitted_eos():
    model, sources = fairseq_model()
    limit = 6
    beams = decoding.Searcher(model).sentences(
        sources[:8], [limit] * 8, decoding.Beam(alpha=0.6, beam_size=3, settle=0), batch_size=8, shape=lambda _: (8, 6)
    )
    for r in beams:
        for w in range(3):
            out = [int(t) for t in r.tokens[w, : int(r.lengths[w])]]
            assert out and FAIRSEQ_IDS.pad not in out and FAIRSEQ_IDS.eos not in out[:-1]
            assert out[-1] == FAIRSEQ_IDS.eos or len(out) == limit


def test_batches_start_the_target_from_eos_and_end_it_with_eos():
    src, tgt = [[5, 6, 7], [8, 9]], [[10, 11], [12, 13, 14]]
    examples = batching.from_ids(src, tgt, 8, eos=FAIRSEQ_IDS.eos)
    batch = batching.assemble(examples, batching.one_per_row(np.arange(2), (2, 8, 8)), FAIRSEQ_IDS)
    assert batch["tgt_in"][0, :3].tolist() == [2, 10, 11] and batch["tgt_out"][0, :3].tolist() == [10, 11, 2]
    assert batch["tgt_in"][1, :4].tolist() == [2, 12, 13, 14] and batch["tgt_out"][1, :4].tolist() == [12, 13, 14, 2]
    assert batch["tgt_segment_ids"][1, :5].tolist() == [1, 1, 1, 1, 0]


class DigitsTokenizer:
    """Text of space-separated ids <-> those ids, with fairseq's reserved ids."""

    ids = FAIRSEQ_IDS

    def encode_source_batch(self, texts):
        return [[int(x) for x in t.split()] for t in texts]

    encode_target_batch = encode_source_batch


def test_teacher_forced_scores_start_from_eos():
    """score_pairs (packed rows, the offset restarting with each pair) equals log P of [y..., eos] after [eos, y...]
    computed one pair at a time."""
    model, _ = fairseq_model()
    sources, targets = ["5 6 7", "8 9 10 11", "12"], ["20 21", "22 23 24", ""]
    scores, stats = score_pairs(model, DigitsTokenizer(), sources, targets, batch_size=8, max_len=16)
    for s, t, score in zip(sources, targets, scores, strict=True):
        src = [int(x) for x in s.split()] + [FAIRSEQ_IDS.eos]
        y = [int(x) for x in t.split()]
        tgt_in, tgt_out = [FAIRSEQ_IDS.bos, *y], [*y, FAIRSEQ_IDS.eos]
        log_probs = jax.nn.log_softmax(forward(model, jnp.asarray([src]), jnp.asarray([tgt_in]))[0], -1)
        expected = float(np.sum(np.asarray(log_probs)[np.arange(len(tgt_out)), tgt_out]))
        assert score.tokens == len(tgt_out)
        assert score.log_prob == pytest.approx(expected, abs=1e-4)
    assert stats["tokens"] == 3 + 4 + 1


@pytest.fixture(scope="module")
def fairseq_tokenizer(tmp_path_factory):
    """A SentencePiece tokenizer trained here (its own ids), read as a converted model's would be: with bos = eos."""
    directory = write_corpus(tmp_path_factory.mktemp("corpus"), n_train=60)
    lines = directory.joinpath("train.en").read_text().splitlines()
    tokenizer = train_tokenizer(
        lines, directory / "spm.model", vocab_size=300, model_type="unigram", ids=SpecialIds(0, 1, 2, 3)
    )
    converted = copy.copy(tokenizer)
    converted.ids = SpecialIds(pad=0, eos=1, bos=1, unk=3)
    return converted


def test_decode_drops_a_leading_bos_equal_to_eos_and_stops_at_the_next_eos(fairseq_tokenizer):
    tok = fairseq_tokenizer
    words = tok.encode_target("the dog")
    text = tok.decode_target(words)
    assert text and tok.decode_target([1, *words]) == text  # the decoder's first input ends nothing
    assert tok.decode_target([*words, 1, *words]) == text  # an emitted eos ends the output
    assert tok.decode_target([*words, 1, 0, 0]) == text
    assert tok.decode_target([1]) == "" and tok.decode_target([1, 0, 0]) == ""  # eos emitted first: empty


def test_a_sentencepiece_model_trained_here_cannot_reserve_one_piece_for_bos_and_eos(tmp_path):
    with pytest.raises(DataError, match=r"model.bos_id \(1\) other than model.eos_id"):
        train_tokenizer(["a b"], tmp_path / "spm.model", vocab_size=10, model_type="bpe", ids=SpecialIds(0, 1, 1, 3))
    assert not (tmp_path / "spm.model").exists()


def test_bos_may_equal_eos_but_not_unk():
    assert SpecialIds.of(tiny_spec(**FAIRSEQ_KEYS)) == FAIRSEQ_IDS
    with pytest.raises(ConfigError, match="^config key model.unk_id: equals model.bos_id"):
        tiny_spec(**{**FAIRSEQ_KEYS, "unk_id": 2, "eos_id": 0, "pad_id": 1})


# -- the keys and the exports ------------------------------------------------------------------------------------


def test_the_keys_are_architecture_keys_that_must_match_on_resume():
    for name in ("model.sinusoid_layout", "model.position_offset"):
        assert name in schema.MUST_MATCH and name in schema.ARCHITECTURE
    saved = json.loads(common.base_config("tiny").to_json())
    changed = common.base_config("tiny")
    changed.model.position_offset = OFFSET
    assert checkpoints.config_differences(saved, json.loads(changed.to_json()))[0].startswith("model.position_offset:")


def test_a_config_saved_without_the_offset_loads_as_the_model_it_was():
    saved = common.base_config("tiny").to_dict()
    del saved["model"]["position_offset"]
    old = bookkeeping.upgrade_config(ml_collections.ConfigDict(json.loads(json.dumps(saved))))
    assert old.model.position_offset == 0
    assert TransformerSpec.from_config(old) == TransformerSpec.from_config(common.base_config("tiny"))


@pytest.mark.parametrize(
    "overrides, reason",
    [
        (dict(sinusoid_layout="fairseq"), "model.sinusoid_layout='fairseq' (Marian's sinusoids have other frequencies"),
        (dict(position_offset=2), "model.position_offset=2 (Marian's positions start at 0)"),
    ],
)
def test_the_marian_export_refuses_fairseq_positions_in_one_line(overrides, reason):
    config = common.base_config("tiny")
    config.model.update(overrides)
    with pytest.raises(ConfigError, match="^cannot export to Marian: " + re.escape(reason)) as e:
        marian.check_exportable(config)
    assert "\n" not in str(e.value)
