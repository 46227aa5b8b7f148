"""The rows of Table 3 of "Attention Is All You Need" as sweep variants of the base model.

--config configs/ablations_table3.py:scale=paper         WMT14 En-De, base model, paper steps (needs accelerators)
--config configs/ablations_table3.py:scale=small,steps=N  Multi30k on a CPU, small model, N steps per variant
--config configs/ablations_table3.py:scale=tiny,steps=N   seconds per variant (tests)

Values are the paper's at scale=paper; at small scales they keep the same ratios to the smaller model
(d_k = d_model / h for rows A and C, d_k = d_model/32 and d_model/16 for row B, half and double N, d_model, d_ff).
"""

from __future__ import annotations

import ml_collections

from configs import common, multi30k, wmt14_ende


def get_config(arg: str | None = None) -> ml_collections.ConfigDict:
    args = common.parse_arg(arg, scale="small", steps="0")
    if args["scale"] == "paper":
        config = wmt14_ende.get_config("size=base")
    elif args["scale"] in ("small", "tiny"):
        config = multi30k.get_config(f"size={args['scale']}")
    else:
        raise ValueError(f"scale must be paper, small or tiny; got {args['scale']!r}")
    steps = int(args["steps"])
    with config.unlocked():
        if steps:
            config.train.num_steps = steps
            config.ckpt.every_steps = max(steps // 4, 1)
            config.train.eval_every = steps
            config.train.bleu_every = steps
            config.opt.warmup_steps = min(config.opt.warmup_steps, max(steps // 5, 1))
    return config.lock()


def get_sweep(arg: str | None = None) -> list[dict]:
    config = get_config(arg)
    d, h, d_ff, n = config.model.d_model, config.model.num_heads, config.model.d_ff, config.model.num_encoder_layers
    rows: list[dict] = [{"name": "base"}]
    # (A) number of heads at constant computation: d_k = d_v = d_model / h.
    for heads in (1, 4, 16, 32):
        if heads != h and d % heads == 0:
            rows.append(
                {
                    "name": f"A_h{heads}",
                    "model.num_heads": heads,
                    "model.qk_head_dim": d // heads,
                    "model.v_head_dim": d // heads,
                }
            )
    # (B) smaller attention key size d_k (16 and 32 at d_model 512).
    for dk in (d // 32, d // 16):
        rows.append({"name": f"B_dk{dk}", "model.qk_head_dim": dk})
    # (C) model size: layers, width (d_k = d_model / h), FFN width.
    for layers in (2, 4, 8):
        if layers != n:
            rows.append(
                {"name": f"C_N{layers}", "model.num_encoder_layers": layers, "model.num_decoder_layers": layers}
            )
    for width in (d // 2, 2 * d):
        # The paper's rate scales as d_model^-0.5; keep that relation for the changed width.
        lr = config.opt.learning_rate * (width / d) ** -0.5
        rows.append({"name": f"C_d{width}", "model.d_model": width, "opt.learning_rate": lr})
    for ffn in (d_ff // 2, 2 * d_ff):
        rows.append({"name": f"C_ff{ffn}", "model.d_ff": ffn})
    # (D) dropout and label smoothing.
    for p_drop in (0.0, 0.2):
        rows.append({"name": f"D_drop{p_drop}", "model.dropout_rate": p_drop})
    for eps in (0.0, 0.2):
        rows.append({"name": f"D_ls{eps}", "train.label_smoothing": eps})
    # (E) learned positional embedding instead of sinusoids.
    rows.append({"name": "E_learned", "model.positional": "learned"})
    return rows
