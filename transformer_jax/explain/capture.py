"""Run one sentence through a restored model and keep what its own modules computed on the way.

The translation is evaluate.py's (evaluation.translate.translate with the settings evaluation.run.decoding_settings
makes of a Decoding record); the beam's hypotheses after each step come from decoding's own search, rerun with the
length limit raised one step at a time; the intermediates come from one teacher-forced call of the model with the
modules' capture points on (model.transformer.capture_intermediates), the pass the attention pictures capture
(visualize.attention.sown_forward): nothing here re-implements a layer.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from transformer_jax import decoding
from transformer_jax.errors import VisualizeError
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice, restore_model, workdir_tokenizer
from transformer_jax.evaluation.run import Decoding, check_numbers, decoding_settings
from transformer_jax.evaluation.translate import (
    DecodeSettings,
    batch_shape,
    input_limit,
    output_cap,
    output_limit,
    position_limit,
    source_ids,
    translate,
)
from transformer_jax.model.layers import SpecialIds
from transformer_jax.model.transformer import capture_intermediates
from transformer_jax.visualize.attention import check_selection, sown_forward


@dataclasses.dataclass
class Hypothesis:
    """One beam after a search step: its pieces, log P and score log P / lp(|Y|), and whether it emitted </s>."""

    pieces: list[str]
    log_prob: float
    score: float
    ended: bool


@dataclasses.dataclass
class Explanation:
    """Everything the page shows about one sentence, as the model computed it (numpy, batch axis removed)."""

    sentence: str
    src_ids: list[int]  # source ids then EOS, as translate() feeds them
    src_pieces: list[str]
    tgt_in_ids: list[int]  # BOS then the target ids: the decoder's input in the teacher-forced pass
    tgt_in_pieces: list[str]
    target_given: bool  # --target given (else the target is the model's own translation)
    truncated: tuple[int, int] | None  # (source tokens before, after) when the sentence was cut to the limit
    translation: str  # evaluate.py's output for the sentence
    beam_steps: list[list[Hypothesis]]  # per search step, the live beams, best first
    settings: dict[str, Any]  # decoding settings (beam_size, alpha, max_extra_len, max_input_len)
    steps: list[int]  # checkpoint steps averaged
    layer: int
    head: int
    spec: Any  # model.spec
    sown: dict[str, Any]  # the modules' intermediates, as nnx.Intermediate nests them, batch row 0
    logits_TV: np.ndarray
    vocab: list[str] = dataclasses.field(repr=False)  # id -> piece, for the top-5 tables

    def attention(self, stack: str, module: str, name: str) -> np.ndarray:
        """An intermediate of the chosen layer's attention module ('q', 'k', 'v', 'attention_weights', ...)."""
        return self.sown[stack][self.layer][module][name]


def restore(workdir: str, choice: CheckpointChoice, options: dict[str, Any]):
    """(config, model, tokenizer, steps, decoding settings), restored as evaluate.py restores them."""
    if not Path(workdir).is_dir():
        raise VisualizeError(f"--workdir {workdir}: no such directory")
    choice = check_choice(choice)
    check_numbers(options, "--")
    decoding_record = Decoding(**options)
    config, model, steps = restore_model(workdir, choice)
    tokenizer = workdir_tokenizer(config, workdir)
    return config, model, tokenizer, steps, decoding_settings(decoding_record, config)


def beam_steps(model: Any, src_ids: list[int], settings: DecodeSettings, vocab: list[str]) -> tuple[list, list[int]]:
    """The live hypotheses after each search step, and the best final hypothesis's ids (EOS included).

    decoding's search with a sentence limit of t steps runs exactly the first t steps of the full search (the
    limit only marks every beam finished after step t), so raising t one step at a time shows each step's beams.
    The batch has translate()'s shape (its rows, its padded length, its dummy rows: an empty source decoded for one
    step), so the search compiled for the translation serves every t, and row 0 computes what translate() did.
    """
    positions = position_limit(model.spec)
    cap = output_cap(settings.max_len, positions)
    limit = input_limit(settings.max_input_len, positions)
    src_len, max_steps = batch_shape(len(src_ids), limit, settings.max_extra_len, cap)  # translate()'s, for one source
    ids = SpecialIds.of(model.spec)
    src_BS = decoding.source_batch([src_ids], settings.batch_size, src_len, ids)
    sentence_limit = output_limit(len(src_ids), settings.max_extra_len, cap)
    search = decoding.Searcher(model)

    def run(t: int) -> decoding.BeamResult:
        max_len_B = np.ones((settings.batch_size,), np.int32)
        max_len_B[0] = t
        result = search(src_BS, max_len_B, settings.search, max_steps=max_steps)
        return decoding.BeamResult(*(np.asarray(x[0]) for x in result))

    final = run(sentence_limit)
    finite = np.isfinite(final.scores)
    total = int(final.lengths[finite].max())
    steps = []
    for t in range(1, total + 1):
        r = final if t == total else run(t)
        steps.append(
            [
                Hypothesis(
                    [vocab[i] for i in r.tokens[w, : r.lengths[w]]],
                    float(r.log_probs[w]),
                    float(r.scores[w]),
                    bool(r.lengths[w] and r.tokens[w, r.lengths[w] - 1] == ids.eos),
                )
                for w in range(len(r.scores))
                if np.isfinite(r.scores[w])
            ]
        )
    best = final.tokens[0, : final.lengths[0]].tolist()
    return steps, best


def check_sentence(sentence: str) -> None:
    if not sentence.strip():
        raise VisualizeError("the sentence is empty; give the sentence to explain as the argument, in quotes")


def explain(
    workdir: str,
    sentence: str,
    *,
    target: str | None = None,
    layer: int = 0,
    head: int = 0,
    choice: CheckpointChoice = LATEST,
    beam_size: int | None = None,
    alpha: float | None = None,
) -> Explanation:
    """Restores the model as evaluate.py does, translates the sentence, and captures every intermediate."""
    check_sentence(sentence)  # before the (slow) restore
    if target is not None and not target.strip():
        raise VisualizeError("--target is empty; give the target sentence, or leave out --target for the translation")
    config, model, tokenizer, steps, settings = restore(workdir, choice, {"beam_size": beam_size, "alpha": alpha})
    spec = model.spec
    check_selection(spec.num_encoder_layers, spec.num_decoder_layers, spec.num_heads, layer, head, both=True)
    limit = input_limit(settings.max_input_len, position_limit(spec))
    src_ids, cut = source_ids(tokenizer, sentence, limit)  # translate()'s rule; the sentence is not blank here
    truncated = (len(tokenizer.encode_source(sentence)) + 1, limit) if cut else None  # (tokens before, after)
    [translation], _ = translate(model, tokenizer, [sentence], settings)

    vocab = tokenizer.target_pieces(range(tokenizer.vocab_size))
    vocab += [f"<id {i}>" for i in range(len(vocab), spec.vocab_size)]  # ids the tokenizer lacks: never emitted
    steps_beams, best = beam_steps(model, src_ids, settings, vocab)
    ids = SpecialIds.of(spec)
    if target is not None:
        tgt_ids = list(tokenizer.encode_target(target))
    else:
        tgt_ids = [t for t in best if t not in (ids.eos, ids.pad)]
    if spec.positional == "learned":
        tgt_ids = tgt_ids[: position_limit(spec) - 1]
    tgt_in_ids = [ids.bos, *tgt_ids]
    logits_TV, sown = sown_forward(model, src_ids, tgt_in_ids, capture_intermediates)
    return Explanation(
        sentence=sentence,
        src_ids=src_ids,
        src_pieces=tokenizer.source_pieces(src_ids),
        tgt_in_ids=tgt_in_ids,
        tgt_in_pieces=[vocab[i] for i in tgt_in_ids],
        target_given=target is not None,
        truncated=truncated,
        translation=translation,
        beam_steps=steps_beams,
        settings={**settings.report(), "max_input_len": limit},
        steps=steps,
        layer=layer,
        head=head,
        spec=spec,
        sown=sown,
        logits_TV=logits_TV,
        vocab=vocab,
    )
