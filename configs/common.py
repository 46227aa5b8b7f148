"""Shared config groups. Every default of the project lives here or in a config file that calls these.

Config files call `base_config(size=...)` and then override what differs. Every leaf says its unit.
"""

from __future__ import annotations

import ml_collections

# name: (d_model, num_heads, d_ff, encoder layers, decoder layers, P_drop)
SIZES = {
    "tiny": (32, 4, 64, 2, 2, 0.1),  # a laptop CPU runs every config in seconds
    "mini": (128, 4, 512, 3, 3, 0.1),  # ablation sweeps on a 2-core CPU: ~0.3 s per 1k-token step
    "small": (256, 4, 1024, 3, 3, 0.1),  # Multi30k on a 2-core CPU
    "base": (512, 8, 2048, 6, 6, 0.1),  # paper Table 3, base
    "big": (1024, 16, 4096, 6, 6, 0.3),  # paper Table 3, big
}


def parse_arg(arg: str | None, **defaults: str) -> dict[str, str]:
    """Parses 'key=value,key=value' (the config-file argument after ':'); unknown keys fail with the known ones."""
    values = dict(defaults)
    for item in filter(None, (arg or "").split(",")):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"config argument {item!r} is not key=value; known keys: {sorted(defaults)}")
        if key not in defaults:
            raise ValueError(f"unknown config argument {key!r}; known keys: {sorted(defaults)}")
        values[key] = value
    return values


def model_config(size: str) -> ml_collections.ConfigDict:
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    d_model, num_heads, d_ff, enc_layers, dec_layers, p_drop = SIZES[size]
    m = ml_collections.ConfigDict()
    m.vocab_size = 32000  # tokens in the joint source-target vocabulary (paper: ~37k for En-De)
    m.d_model = d_model  # width of every residual stream
    m.num_heads = num_heads  # h, attention heads per layer
    m.num_kv_heads = 0  # key/value heads (grouped-query attention); 0 means num_heads (the paper)
    m.qk_head_dim = 0  # d_k per head; 0 means d_model / num_heads (the paper)
    m.v_head_dim = 0  # d_v per head; 0 means d_model / num_heads (the paper)
    m.d_ff = d_ff  # inner width of the position-wise feed-forward network
    m.num_encoder_layers = enc_layers  # N for the encoder
    m.num_decoder_layers = dec_layers  # N for the decoder
    m.dropout_rate = p_drop  # P_drop on sublayer outputs and on embedding + PE sums
    m.attention_dropout_rate = 0.0  # dropout on attention weights (not in the paper)
    m.ffn_dropout_rate = 0.0  # dropout on the FFN hidden activation (not in the paper)
    m.activation = "relu"  # relu (paper) | gelu | swiglu
    m.norm = "layernorm"  # layernorm (paper) | rmsnorm
    m.norm_position = "post"  # post: LayerNorm(x + Sublayer(x)) (paper) | pre: x + Sublayer(LayerNorm(x))
    m.norm_epsilon = 1e-6  # epsilon added to the variance inside the norm
    m.positional = "sinusoidal"  # sinusoidal (paper) | learned | none
    m.max_len = 1024  # positions a learned positional embedding holds (tokens)
    m.share_embeddings = True  # one matrix for source and target embeddings (paper 3.4)
    m.tie_output = True  # the output softmax reuses the target embedding matrix (paper 3.4)
    m.dtype = "float32"  # computation dtype: float32 | bfloat16; parameters stay float32
    # Hand-written backward passes of the linear layers, the tied logits projection and the loss, arranged for
    # XLA:CPU (same gradients as autodiff, fewer transposed copies): auto = on for the CPU backend only | on | off
    m.fused_backward = "auto"
    return m


def attention_config() -> ml_collections.ConfigDict:
    a = ml_collections.ConfigDict()
    a.impl = "xla"  # ops.attention implementation: xla | blockwise | pallas | cudnn | auto
    a.window = 0  # local attention window in tokens; 0 means full attention
    return a


def data_config() -> ml_collections.ConfigDict:
    d = ml_collections.ConfigDict()
    d.source = "text"  # text (a directory of {split}.{lang} files) | multi30k (fetched) | tfds
    d.text_dir = "../shared/data/multi30k"  # directory with {split}.{lang} files, for source=text
    d.tfds_name = "wmt14_translate/de-en"  # TFDS builder/config, for source=tfds
    d.tfds_data_dir = ""  # TFDS data directory; empty means TFDS's default (~/tensorflow_datasets)
    d.tfds_download = True  # download and prepare a missing TFDS dataset (needs internet); False fails at once
    d.cache_dir = ""  # where downloads are kept; empty means ~/.cache/transformer_jax
    d.src_lang = "en"  # source language code
    d.tgt_lang = "de"  # target language code
    d.train_split = "train"  # split names as the source calls them
    d.valid_split = "valid"
    d.test_split = "test"
    d.tokenizer_model = ""  # an existing SentencePiece .model file; empty means train one into the workdir
    d.tokenizer_type = "unigram"  # unigram | bpe
    d.tokenizer_sample_sentences = 1_000_000  # sentences (both sides together) sampled to train the tokenizer
    d.store = True  # tokenize the training split once into memory-mapped files (False: in memory at every start)
    d.store_dir = ""  # directory of those files; empty means the tokenizer's directory
    d.batching = "pack"  # pack | bucket | pad
    d.batch_size = 64  # rows per batch, summed over devices (pack, pad)
    d.tokens_per_batch = 4096  # token slots per side per batch (rows x row length), summed over devices (bucket)
    d.batch_window = 8192  # examples per host grouped at once by pack (first-fit) and bucket (length sort)
    d.max_len = 64  # tokens per side: the row length for pack/pad and the training length filter
    d.eval_max_len = 256  # tokens per source sentence at evaluation; longer ones are truncated and counted
    d.shuffle_seed = 0  # seed of the deterministic shuffle
    return d


def opt_config(d_model: int) -> ml_collections.ConfigDict:
    o = ml_collections.ConfigDict()
    o.optimizer = "adam"  # adam | adamw
    o.b1 = 0.9  # Adam beta1 (paper)
    o.b2 = 0.98  # Adam beta2 (paper)
    o.eps = 1e-9  # Adam epsilon (paper)
    o.weight_decay = 0.0  # decoupled weight decay per step, for adamw
    o.schedule = "paper"  # paper: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) | rsqrt | cosine | constant
    o.learning_rate = d_model**-0.5  # peak multiplier (paper: d_model^-0.5); for cosine/constant the peak rate
    o.warmup_steps = 4000  # steps of linear warmup
    o.clip_grad_norm = 0.0  # global-norm clipping threshold; 0 means no clipping
    return o


def train_config() -> ml_collections.ConfigDict:
    t = ml_collections.ConfigDict()
    t.seed = 0  # seed of parameter init and dropout
    t.num_steps = 100_000  # optimizer steps
    t.grad_accum_steps = 1  # micro-batches per optimizer step
    t.label_smoothing = 0.1  # epsilon_ls (paper)
    t.log_every = 100  # steps between metric logs
    t.eval_every = 1000  # steps between validation-loss evaluations
    t.bleu_every = 0  # steps between validation BLEU evaluations; 0 means never during training
    t.bleu_sentences = 200  # validation sentences decoded for BLEU during training
    t.mesh = "data"  # data (replicated params) | fsdp (parameters sharded over the data axis)
    t.peak_flops = 0.0  # peak FLOP/s of one device, for MFU and --dry_run's estimate; 0: measure a matmul at start
    t.assumed_mfu = 0.4  # model FLOPs utilisation assumed by --dry_run's time estimate (fraction of peak)
    t.estimate_devices = 0  # devices assumed by --dry_run's time estimate; 0 means the devices present
    t.max_nonfinite_steps = 10  # consecutive non-finite updates before the run stops
    return t


def eval_config() -> ml_collections.ConfigDict:
    e = ml_collections.ConfigDict()
    e.beam_size = 4  # beams (paper)
    e.alpha = 0.6  # length penalty exponent (paper)
    e.max_extra_len = 50  # maximum output length = input length + this (paper)
    e.average_last = 5  # checkpoints averaged for the final model (paper: 5 base, 20 big)
    e.batch_size = 64  # sentences per decoding batch
    return e


def ckpt_config() -> ml_collections.ConfigDict:
    c = ml_collections.ConfigDict()
    c.every_steps = 1000  # steps between checkpoints
    c.keep = 20  # checkpoints kept (enough for averaging)
    c.async_save = True  # save in the background
    return c


def base_config(size: str) -> ml_collections.ConfigDict:
    """All groups with their defaults for a model size; config files override and then lock."""
    config = ml_collections.ConfigDict()
    config.size = size
    config.model = model_config(size)
    config.attention = attention_config()
    config.data = data_config()
    config.opt = opt_config(config.model.d_model)
    config.train = train_config()
    config.eval = eval_config()
    config.ckpt = ckpt_config()
    return config
