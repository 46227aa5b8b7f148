"""configs/wmt14_ende.py reproduces the paper's setup: each hyperparameter checked against the paper's text."""

import pytest

from configs import wmt14_ende

# Vaswani et al. 2017: Table 3 (sizes, P_drop, eps_ls, steps), 5.1 (vocabulary, batch), 5.3 (Adam, schedule),
# 6.1 (checkpoint averaging, beam, alpha, maximum output length).
PAPER = {
    "base": {
        "model.d_model": 512,
        "model.num_heads": 8,
        "model.d_ff": 2048,
        "model.num_encoder_layers": 6,
        "model.num_decoder_layers": 6,
        "model.dropout_rate": 0.1,
        "train.num_steps": 100_000,
        "eval.average_last": 5,
    },
    "big": {
        "model.d_model": 1024,
        "model.num_heads": 16,
        "model.d_ff": 4096,
        "model.num_encoder_layers": 6,
        "model.num_decoder_layers": 6,
        "model.dropout_rate": 0.3,
        "train.num_steps": 300_000,
        "eval.average_last": 20,
    },
}
SHARED = {
    "model.vocab_size": 37000,
    "model.share_embeddings": True,
    "model.tie_output": True,
    "model.positional": "sinusoidal",
    "model.activation": "relu",
    "model.norm_position": "post",
    "model.norm": "layernorm",
    "model.qk_head_dim": 0,  # d_k = d_v = d_model / h
    "model.v_head_dim": 0,
    "train.label_smoothing": 0.1,
    "opt.optimizer": "adam",
    "opt.b1": 0.9,
    "opt.b2": 0.98,
    "opt.eps": 1e-9,
    "opt.schedule": "paper",
    "opt.warmup_steps": 4000,
    "opt.weight_decay": 0.0,
    "opt.clip_grad_norm": 0.0,
    "train.grad_accum_steps": 1,
    "eval.beam_size": 4,
    "eval.alpha": 0.6,
    "eval.max_extra_len": 50,
    "data.tfds_name": "wmt14_translate/de-en",
    "data.src_lang": "en",
    "data.tgt_lang": "de",
    "data.valid_split": "validation",  # newstest2013
    "data.test_split": "test",  # newstest2014
}


def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize("size", ["base", "big"])
def test_wmt14_config_matches_the_paper(size):
    config = wmt14_ende.get_config(f"size={size}")
    drift = {}
    for key, expected in {**SHARED, **PAPER[size]}.items():
        if _get(config, key) != expected:
            drift[key] = (_get(config, key), expected)
    assert not drift, f"hyperparameters drifted from the paper (config, paper): {drift}"
    assert config.opt.learning_rate == pytest.approx(config.model.d_model**-0.5)  # lrate = d_model^-0.5 * ...
    # About 25,000 source and 25,000 target tokens per step (5.1), batched by length.
    assert config.data.batching == "bucket"
    assert 24_000 <= config.data.tokens_per_batch <= 26_000
