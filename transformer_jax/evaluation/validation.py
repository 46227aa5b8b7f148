"""Validation BLEU for the trainer: the function training.loop receives, so that training never imports evaluation.

big_vision's evaluators work this way: the trainer hands the model to a function built outside it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ml_collections

from transformer_jax import data, decoding
from transformer_jax.evaluation.bleu import score_all
from transformer_jax.evaluation.translate import DecodeSettings, translate


def decoding_settings(config: ml_collections.ConfigDict) -> DecodeSettings:
    """translate()'s settings for validation BLEU: config.eval's search (decoding.search_for: greedy or beam, GNMT
    length penalty), sources cut at data.eval_max_len (as evaluate.py)."""
    return DecodeSettings(
        search=decoding.search_for(config.eval.beam_size, config.eval.alpha),
        max_extra_len=config.eval.max_extra_len,
        batch_size=config.eval.batch_size,
        max_input_len=config.data.eval_max_len,
    )


def bleu_evaluator(config: ml_collections.ConfigDict, tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """A function of the model (eval mode) -> sacreBLEU, tokenized BLEU and chrF of its beam-search translations of
    the first train.bleu_sentences validation pairs, decoded with config.eval's settings (as evaluate.py)."""
    pairs = data.load_split(config.data, config.data.valid_split)[: config.train.bleu_sentences]
    sources, references = [s for s, _ in pairs], [t for _, t in pairs]
    settings = decoding_settings(config)

    def evaluate(model: Any) -> dict[str, float]:
        hypotheses, _ = translate(model, tokenizer, sources, settings)
        return {name: float(value["score"]) for name, value in score_all(hypotheses, references).items()}

    return evaluate
