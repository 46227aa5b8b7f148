"""Validation BLEU for the trainer: the function training.loop receives, so that training never imports evaluation.

big_vision's evaluators work this way: the trainer hands the model to a function built outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from transformer_jax import decoding
from transformer_jax.evaluation.bleu import score_all
from transformer_jax.evaluation.translate import DecodeSettings, translate
from transformer_jax.training.loop import validation_sets


def decoding_settings(config: ml_collections.ConfigDict) -> DecodeSettings:
    """translate()'s settings for validation BLEU: config.eval's search (decoding.search_for: greedy or beam, GNMT
    length penalty), sources cut at data.eval_max_len (as evaluate.py)."""
    return DecodeSettings(
        search=decoding.search_for(config.eval.beam_size, config.eval.alpha),
        max_extra_len=config.eval.max_extra_len,
        max_len=config.eval.max_len,
        batch_size=config.eval.batch_size,
        max_input_len=config.data.eval_max_len,
    )


def bleu_evaluator(config: ml_collections.ConfigDict, tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """A function of the model (eval mode) -> sacreBLEU, chrF, chrF++, TER and tokenized BLEU of its beam-search
    translations of the first train.bleu_sentences validation pairs, decoded with config.eval's settings (as
    evaluate.py): `bleu`, ... for data.valid_split, `NAME_bleu`, ... for each eval.extra_valid set."""
    sets = [(name, pairs[: config.train.bleu_sentences]) for name, pairs in validation_sets(config)]
    settings = decoding_settings(config)

    def evaluate(model: Any) -> dict[str, float]:
        out = {}
        for name, pairs in sets:
            hypotheses, _ = translate(model, tokenizer, [s for s, _ in pairs], settings)
            scores = score_all(hypotheses, [t for _, t in pairs])
            out.update({f"{name}_{key}" if name else key: float(value["score"]) for key, value in scores.items()})
        return out

    return evaluate
