"""The rows of Table 3 of "Attention Is All You Need" as sweep variants of the base model.

--config configs/ablations_table3.py:scale=paper         WMT14 En-De, base model, paper steps (needs accelerators)
--config configs/ablations_table3.py:scale=small,steps=N  Multi30k on a CPU, small model, N steps per variant
--config configs/ablations_table3.py:scale=mini,steps=N   Multi30k on a CPU, d_model 128, 1k-token steps (README table)
--config configs/ablations_table3.py:scale=tiny,steps=N   seconds per variant (tests)

Values are the paper's at scale=paper; at small scales they keep the same ratios to the smaller model
(d_k = d_model / h for rows A and C, d_k = d_model/32 and d_model/16 for row B, half and double N, d_model, d_ff).

The README's seeded table: scale=mini,steps=400 with --seeds 3, i.e. 18 variants x 3 seeds, each then decoding all
of val2016, in about 3 hours on the 2-core CPU alone. Estimate: a step costs ~0.31 s at the base row's 15.7 GFLOP
(6,500 tokens/s, source and target counted), the other rows in proportion to their FLOPs (all 18 rows: 19.8 base
rows); each run adds ~25 s of start-up, compilation, validation and checkpoints and ~25 s (times its FLOP ratio) to
decode val2016 with beam 4: 3 x (19.8 x (400 x 0.31 + 25) + 18 x 25) s = 2 h 50 min. 500 steps (one epoch) would
take 3 h 20 min.
"""

from __future__ import annotations

import ml_collections

from configs import common, multi30k, wmt14_ende


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, scale="small", steps="0")
    if args["scale"] == "paper":
        config = wmt14_ende.get_config("size=base")
    elif args["scale"] in ("small", "mini", "tiny"):
        config = multi30k.get_config(f"size={args['scale']}")
    else:
        raise ValueError(f"scale must be paper, small, mini or tiny; got {args['scale']!r}")
    steps = int(args["steps"])
    with config.unlocked():
        if args["scale"] == "mini":
            # Half the tokens per step of the Multi30k config: twice the updates in the same CPU time.
            config.data.batch_size = 16
        if steps:
            config.train.num_steps = steps
            config.ckpt.every_steps = max(steps // 4, 1)
            config.train.eval_every = steps
            # No BLEU during training: the sweep decodes the whole validation split after the last step (200
            # sentences here would cost time and say less); evaluate.py scores a run trained by train.py alone.
            config.train.bleu_every = 0
            warmup = min(config.opt.warmup_steps, max(steps // 5, 1))
            if config.opt.schedule == "paper":
                # The paper's schedule peaks at learning_rate * warmup^-0.5: keep the peak for the shorter warmup.
                config.opt.learning_rate *= (warmup / config.opt.warmup_steps) ** 0.5
            config.opt.warmup_steps = warmup
    return config.lock()


REFERENCE = "paper, Table 3 (newstest2013)"

# Table 3 of the paper: (dev perplexity per wordpiece, dev BLEU) of each row, keyed by the row's change from base
# (d_model 512, h 8, d_ff 2048, N 6). Beam search, no checkpoint averaging, 100k steps.
PAPER = {
    "base": (4.92, 25.8),
    "h1": (5.29, 24.9),
    "h4": (5.00, 25.5),
    "h16": (4.91, 25.8),
    "h32": (5.01, 25.4),
    "dk/32": (5.16, 25.1),  # d_k 16
    "dk/16": (5.01, 25.4),  # d_k 32
    "N2": (6.11, 23.7),
    "N4": (5.19, 25.3),
    "N8": (4.88, 25.5),
    "d/2": (5.75, 24.5),  # d_model 256, d_k 32
    "2d": (4.66, 26.0),  # d_model 1024, d_k 128
    "ff/2": (5.12, 25.4),  # d_ff 1024
    "2ff": (4.75, 26.2),  # d_ff 4096
    "drop0.0": (5.77, 24.6),
    "drop0.2": (4.95, 25.5),
    "ls0.0": (4.67, 25.3),
    "ls0.2": (5.47, 25.7),
    "learned": (4.92, 25.7),
}


def _row(name: str, paper_key: str, **overrides) -> dict:
    ppl, bleu = PAPER[paper_key]
    return {"name": name, "reference": {"valid_perplexity": ppl, "valid_bleu": bleu}, **overrides}


def get_sweep(arg: str | None = None) -> list[dict]:
    config = get_config(arg)
    d, h, d_ff, n = config.model.d_model, config.model.num_heads, config.model.d_ff, config.model.num_encoder_layers
    rows: list[dict] = [_row("base", "base")]
    # (A) number of heads at constant computation: d_k = d_v = d_model / h. Compared with the paper's row of the
    # same head count (at small scales the base has 4 heads, so its own h=4 row is the base).
    for heads in (1, 4, 16, 32):
        if heads != h and d % heads == 0:
            dk = d // heads
            overrides = {"model.num_heads": heads, "model.qk_head_dim": dk, "model.v_head_dim": dk}
            rows.append(_row(f"A_h{heads}", f"h{heads}", **overrides))
    # (B) smaller attention key size d_k (16 and 32 at d_model 512).
    for dk, key in ((d // 32, "dk/32"), (d // 16, "dk/16")):
        rows.append(_row(f"B_dk{dk}", key, **{"model.qk_head_dim": dk}))
    # (C) model size: layers, width (d_k = d_model / h), FFN width.
    for layers in (2, 4, 8):
        if layers != n:
            overrides = {"model.num_encoder_layers": layers, "model.num_decoder_layers": layers}
            rows.append(_row(f"C_N{layers}", f"N{layers}", **overrides))
    for width, key in ((d // 2, "d/2"), (2 * d, "2d")):
        # The paper's rate scales as d_model^-0.5; keep that relation for the changed width.
        lr = config.opt.learning_rate * (width / d) ** -0.5
        rows.append(_row(f"C_d{width}", key, **{"model.d_model": width, "opt.learning_rate": lr}))
    for ffn, key in ((d_ff // 2, "ff/2"), (2 * d_ff, "2ff")):
        rows.append(_row(f"C_ff{ffn}", key, **{"model.d_ff": ffn}))
    # (D) dropout and label smoothing.
    for p_drop in (0.0, 0.2):
        rows.append(_row(f"D_drop{p_drop}", f"drop{p_drop}", **{"model.dropout_rate": p_drop}))
    for eps in (0.0, 0.2):
        rows.append(_row(f"D_ls{eps}", f"ls{eps}", **{"train.label_smoothing": eps}))
    # (E) learned positional embedding instead of sinusoids.
    rows.append(_row("E_learned", "learned", **{"model.positional": "learned"}))
    return rows
