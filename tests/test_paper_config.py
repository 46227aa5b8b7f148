"""configs/wmt14_ende.py and configs/wmt14_enfr.py reproduce the paper's setups: each hyperparameter checked
against the paper's text."""

import pytest

from configs import wmt14_ende, wmt14_enfr

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
    "data.source": "tfds",
    "data.valid_split": "validation",  # newstest2013
    "data.test_split": "test",  # newstest2014
}
# What differs between the two tasks (5.1, 6.1 and Table 2).
TASKS = {
    "en-de": {
        "module": wmt14_ende,
        "config": {
            "data.tfds_name": "wmt14_translate/de-en",
            "data.src_lang": "en",
            "data.tgt_lang": "de",
            "model.vocab_size": 37000,  # shared source-target BPE vocabulary
        },
        "big": {},
        "bleu": {"base": 27.3, "big": 28.4},
    },
    "en-fr": {
        "module": wmt14_enfr,
        "config": {
            "data.tfds_name": "wmt14_translate/fr-en",
            "data.src_lang": "en",
            "data.tgt_lang": "fr",
            "model.vocab_size": 32000,  # 32000 word-piece vocabulary
        },
        "big": {"model.dropout_rate": 0.1},  # "used dropout rate P_drop = 0.1, instead of 0.3"
        "bleu": {"base": 38.1, "big": 41.8},
    },
}


def _get(config, dotted: str):
    value = config
    for part in dotted.split("."):
        value = value[part]
    return value


@pytest.mark.parametrize("task", sorted(TASKS))
@pytest.mark.parametrize("size", ["base", "big"])
def test_wmt14_config_matches_the_paper(task, size):
    spec = TASKS[task]
    config = spec["module"].get_config(f"size={size}")
    assert spec["module"].PAPER_BLEU[size] == spec["bleu"][size]  # newstest2014, Table 2
    wanted = {**SHARED, **PAPER[size], **spec["config"], **(spec["big"] if size == "big" else {})}
    drift = {}
    for key, expected in wanted.items():
        if _get(config, key) != expected:
            drift[key] = (_get(config, key), expected)
    assert not drift, f"hyperparameters drifted from the paper (config, paper): {drift}"
    assert config.opt.learning_rate == pytest.approx(config.model.d_model**-0.5)  # lrate = d_model^-0.5 * ...
    # About 25,000 source and 25,000 target tokens per step (5.1), batched by length.
    assert config.data.batching == "bucket"
    assert 24_000 <= config.data.tokens_per_batch <= 26_000
