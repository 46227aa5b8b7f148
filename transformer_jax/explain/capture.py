"""Run one sentence through a restored model and keep what its own modules computed on the way.

The translation is evaluate.py's (evaluation.translate.translate with the settings evaluation.run.decoding_settings
makes of a Decoding record); the beam's hypotheses after each step come from decoding's own search, rerun with the
length limit raised one step at a time; the intermediates come from one teacher-forced pass of model.encode /
model.decode with the modules' capture points on (model.transformer.capture_intermediates): nothing here
re-implements a layer.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from transformer_jax import decoding
from transformer_jax.data.batching import padded_eval_length
from transformer_jax.errors import VisualizeError
from transformer_jax.evaluation.command import Decoding, check_numbers
from transformer_jax.evaluation.restore import LATEST, CheckpointChoice, check_choice, restore_model, workdir_tokenizer
from transformer_jax.evaluation.run import decoding_settings
from transformer_jax.evaluation.translate import (
    DecodeSettings,
    input_limit,
    output_cap,
    output_limit,
    position_limit,
    source_ids,
    translate,
)
from transformer_jax.model.transformer import capture_intermediates
from transformer_jax.tokens import SpecialIds


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
    tgt_out_pieces: list[str]  # the next token at each target step: the target pieces then </s>
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
    memory_SD: np.ndarray
    logits_TV: np.ndarray
    vocab: list[str] = dataclasses.field(repr=False, default_factory=list)  # id -> piece, for the top-5 tables

    def piece(self, i: int) -> str:
        return piece_of(self.vocab, i)

    def attention(self, stack: str, module: str, name: str) -> np.ndarray:
        """An intermediate of the chosen layer's attention module ('q', 'k', 'v', 'attention_weights', ...)."""
        return self.sown[stack][self.layer][module][name]


def piece_of(vocab: list[str], i: int) -> str:
    """The piece of id i; a model may have more ids than its tokenizer, never emitted in training."""
    return vocab[i] if i < len(vocab) else f"<id {i}>"


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


def beam_steps(model: Any, src_ids: list[int], settings: DecodeSettings, piece: Any) -> tuple[list, list[int]]:
    """The live hypotheses after each search step, and the best final hypothesis's ids (EOS included).

    decoding's search with a sentence limit of t steps runs exactly the first t steps of the full search (the
    limit only marks every beam finished after step t), so raising t one step at a time shows each step's beams.
    The batch has translate()'s shape (its rows, its padded length, its dummy rows: an empty source decoded for one
    step), so the search compiled for the translation serves every t, and row 0 computes what translate() did.
    """
    positions = position_limit(model.spec)
    src_len = padded_eval_length(len(src_ids), input_limit(settings.max_input_len, positions))
    cap = output_cap(settings.max_len, positions)
    max_steps = output_limit(src_len, settings.max_extra_len, cap)
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
                    [piece(i) for i in r.tokens[w, : r.lengths[w]]],
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


def _encode_decode(model: Any, src_1S: jax.Array, tgt_in_1T: jax.Array) -> tuple[jax.Array, jax.Array]:
    memory_1SD = model.encode(src_1S)
    return memory_1SD, model.decode(memory_1SD, tgt_in_1T, src_tokens=src_1S)


@nnx.jit
def _teacher_forced(model: Any, src_1S: jax.Array, tgt_in_1T: jax.Array) -> tuple[nnx.State, jax.Array, jax.Array]:
    # Compiled, although for one sentence: op by op, every operation compiles a program of its own, several times
    # slower than compiling the pass once (docs/compilation.md).
    (memory_1SD, logits_1TV), sown = nnx.capture(_encode_decode, nnx.Intermediate)(model, src_1S, tgt_in_1T)
    return sown, memory_1SD, logits_1TV


def intermediates(model: Any, src_ids: list[int], tgt_in_ids: list[int]) -> tuple[dict, np.ndarray, np.ndarray]:
    """(sown intermediates, memory [S, D], logits [T, V]) of one teacher-forced pass with the capture points on."""
    capture_intermediates(model)
    try:
        sown, memory_1SD, logits_1TV = _teacher_forced(
            model, jnp.asarray([src_ids], jnp.int32), jnp.asarray([tgt_in_ids], jnp.int32)
        )
        sown = nnx.to_pure_dict(sown)
    finally:
        capture_intermediates(model, False)
    # Each sown value is a tuple of calls (one per module here), each with the batch axis first.
    sown = jax.tree.map(lambda calls: np.asarray(calls[0][0], np.float32), sown, is_leaf=lambda x: isinstance(x, tuple))
    return sown, np.asarray(memory_1SD[0], np.float32), np.asarray(logits_1TV[0], np.float32)


def check_selection(spec: Any, layer: int, head: int) -> None:
    layers = min(spec.num_encoder_layers, spec.num_decoder_layers)
    if not 0 <= layer < layers:
        raise VisualizeError(
            f"--layer {layer}: the model has {spec.num_encoder_layers} encoder and {spec.num_decoder_layers} decoder "
            f"layers; choose a layer in 0..{layers - 1}"
        )
    if not 0 <= head < spec.num_heads:
        heads = spec.num_heads
        raise VisualizeError(f"--head {head}: the model has {heads} heads; choose a head in 0..{heads - 1}")


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
    check_selection(model.spec, layer, head)
    limit = input_limit(settings.max_input_len, position_limit(model.spec))
    src_ids, cut = source_ids(tokenizer, sentence, limit)  # translate()'s rule; the sentence is not blank here
    truncated = (len(tokenizer.encode_source(sentence)) + 1, limit) if cut else None  # (tokens before, after)
    [translation], _ = translate(model, tokenizer, [sentence], settings)

    vocab = tokenizer.target_pieces(range(tokenizer.vocab_size))

    def piece(i: int) -> str:
        return piece_of(vocab, int(i))

    steps_beams, best = beam_steps(model, src_ids, settings, piece)
    ids = SpecialIds.of(model.spec)
    if target is not None:
        tgt_ids = list(tokenizer.encode_target(target))
    else:
        tgt_ids = [t for t in best if t not in (ids.eos, ids.pad)]
    if model.spec.positional == "learned":
        tgt_ids = tgt_ids[: model.spec.max_len - 1]
    tgt_in_ids = [ids.bos, *tgt_ids]
    sown, memory_SD, logits_TV = intermediates(model, src_ids, tgt_in_ids)
    return Explanation(
        sentence=sentence,
        src_ids=src_ids,
        src_pieces=tokenizer.source_pieces(src_ids),
        tgt_in_ids=tgt_in_ids,
        tgt_in_pieces=[piece(i) for i in tgt_in_ids],
        tgt_out_pieces=[piece(i) for i in [*tgt_ids, ids.eos]],
        target_given=target is not None,
        truncated=truncated,
        translation=translation,
        beam_steps=steps_beams,
        settings={**settings.report(), "max_input_len": limit},
        steps=steps,
        layer=layer,
        head=head,
        spec=model.spec,
        sown=sown,
        memory_SD=memory_SD,
        logits_TV=logits_TV,
        vocab=vocab,
    )
