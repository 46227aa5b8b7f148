"""Every config key, written once: its default, its unit and meaning, what it may hold, and whether it must match
on resume. Everything else derives from `KEYS`: the config groups of configs/common.py (`group`), the rules
transformer_jax/cli.py applies (`RULES`), the keys a restart must share with its checkpoint's config (`MUST_MATCH`), the
keys a fine-tuning run takes from its source (`ARCHITECTURE`) and the model's hyperparameters (model/layers.py's
TransformerSpec has one field per `model.*`/`attention.*` key).

A default is a value, or a function of the model size's row of `SIZES`. Its `doc` says what the number counts;
cli.py's one-line errors quote it. `resume=MATCH` marks a key whose change makes a checkpoint unusable: the
parameter or optimizer structure, what the tokens mean, or which batches the saved data-iterator position stands for
(docs/reliability.md). `architecture=True` is a separate rule: the key shapes the parameters or the computation, or
says what the token ids mean, so a run started from another's parameters (`train.init_from`) takes its value from the
source's saved config (training/init_from.py); regularisation, data, batching and optimizer keys are the fine-tuning
run's own, even where a restart must keep them. Adding a key is one `Key(...)` here (a model key is also a field of
TransformerSpec); tests/test_config_keys.py fails if a key lacks any of its facts. A list-valued key holds a tuple of
strings or of records by its `Entries` rule, which also reads one comma-joined value (a record in its form of before).
Choice sets defined by a registry elsewhere (attention implementations, mesh modes) are read when a config is checked.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import ml_collections

from transformer_jax.config.rules import (
    DIRECTION,
    FLAG,
    IDENTIFIER,
    MATCH,
    MAY_CHANGE,
    NAME,
    REGEX,
    TEXT,
    WORD,
    Entries,
    Field,
    Key,
    Rule,
    at_least_zero,
    choice,
    corpus_from_text,
    count,
    direction_lines_from_text,
    files_pair,
    fraction,
    language_code_from_text,
    positive,
    valid_set_from_text,
)
from transformer_jax.errors import ConfigError


class Size(NamedTuple):
    """The size-dependent defaults of one model size (`size=...` in every config file's argument)."""

    d_model: int
    num_heads: int
    d_ff: int
    encoder_layers: int
    decoder_layers: int
    dropout_rate: float


SIZES = {
    "tiny": Size(32, 4, 64, 2, 2, 0.1),  # a laptop CPU runs every config in seconds
    "mini": Size(128, 4, 512, 3, 3, 0.1),  # ablation sweeps on a 2-core CPU
    "small": Size(256, 4, 1024, 3, 3, 0.1),  # Multi30k on a 2-core CPU
    "base": Size(512, 8, 2048, 6, 6, 0.1),  # paper Table 3, base
    "big": Size(1024, 16, 4096, 6, 6, 0.3),  # paper Table 3, big
}

# Choice sets of string-valued keys whose implementation has no registry of its own (model/layers.py maps DTYPES to
# jax dtypes).
ACTIVATIONS = ("relu", "gelu", "swiglu", "swish")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("post", "pre")
POSITIONALS = ("sinusoidal", "learned", "none")
SINUSOID_LAYOUTS = ("interleaved", "concatenated", "fairseq")  # model/layers.py sinusoidal_encoding
# Where the language tokens of a multilingual model go (data/languages.py says what each does).
LANG_TOKENS = ("none", "source", "target", "source_and_target")
DTYPES = ("float32", "bfloat16", "float16")
FUSED_BACKWARD = ("auto", "on", "off")
SCHEDULES = ("paper", "rsqrt", "cosine", "constant")
OPTIMIZERS = ("adam", "adamw")
DATA_SOURCES = ("text", "multi30k", "tfds")
BATCHINGS = ("pack", "bucket", "pad")
TOKENIZER_TYPES = ("unigram", "bpe")
# data/tokenizer.py: a joint SentencePiece model trained here, a Marian model's, or an M2M-100 / NLLB-200 model's
TOKENIZERS = ("spm", "marian", "fairseq")
# What selects the best checkpoints and stops early: validation loss, or a score of the decoded validation sentences.
LORA_TARGETS = ("q", "k", "v", "o", "ffn", "embed")  # model/lora.py: attention projections, feed-forward, embedding
SELECT_METRICS = ("valid_bleu", "valid_chrf", "valid_chrfpp", "valid_ter", "valid_loss")
SEED_LIMIT = 2**32
# The experiment trackers of train.trackers (training/metrics.py), each with the pinned requirement of the optional
# package it needs (None: a runtime dependency). requirements-dev.txt pins the same; tests/test_trackers.py checks it.
TRACKERS = {"tensorboard": None, "wandb": "wandb==0.31.0", "mlflow": "mlflow==3.17.2"}
CORPUS_KINDS = ("text", "tfds", "files")  # a {split}.{lang} directory, a TFDS builder, a file pair SRC+TGT


def _attention_impls() -> list[str]:
    from transformer_jax import ops  # importing it registers every implementation

    return sorted(ops.IMPLEMENTATIONS)


def _mesh_modes() -> list[str]:
    from transformer_jax.sharding import MESH_MODES

    return list(MESH_MODES)


def _by_size(field: str) -> Callable[[Size], Any]:
    return lambda size: getattr(size, field)


# The reserved ids of a SentencePiece model trained here (data/tokenizer.py refuses one that disagrees).
SPECIAL_IDS = {"pad": 0, "eos": 1, "bos": 2, "unk": 3}

KEYS: tuple[Key, ...] = (
    # set by base_config
    Key("size", None, NAME, "label of the model size the config started from (SIZES)", MAY_CHANGE, architecture=True),
    # model: what the modules are built from (TransformerSpec)
    Key("model.vocab_size", 32000, count(1), "tokens in the joint source-target vocabulary", MATCH, architecture=True),
    # The vocabulary's reserved ids (model.layers.SpecialIds): what the token ids mean, so a fine-tuning run takes them.
    *(
        Key(f"model.{f}_id", SPECIAL_IDS[f], count(0), doc, MATCH, architecture=True)
        for f, doc in (
            ("pad", "token id of padding, never emitted"),
            ("eos", "token id ending every sentence"),
            ("bos", "token id of the first decoder input (may equal model.pad_id or model.eos_id)"),
            ("unk", "token id of an unknown piece"),
        )
    ),
    Key("model.source_vocab_size", 0, count(0), "encoder embedding rows; 0 = vocab_size", MATCH, architecture=True),
    Key("model.d_model", _by_size("d_model"), count(1), "width of every residual stream", MATCH, architecture=True),
    Key("model.num_heads", _by_size("num_heads"), count(1), "h, attention heads per layer", MATCH, architecture=True),
    Key(
        "model.num_kv_heads",
        0,
        count(0),
        "key/value heads (grouped-query attention); 0 = num_heads",
        MATCH,
        architecture=True,
    ),
    Key("model.qk_head_dim", 0, count(0), "d_k per head; 0 = d_model / num_heads", MATCH, architecture=True),
    Key("model.v_head_dim", 0, count(0), "d_v per head; 0 = d_model / num_heads", MATCH, architecture=True),
    Key(
        "model.d_ff",
        _by_size("d_ff"),
        count(1),
        "inner width of the position-wise feed-forward network",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.num_encoder_layers", _by_size("encoder_layers"), count(0), "N, encoder layers", MATCH, architecture=True
    ),
    Key(
        "model.num_decoder_layers", _by_size("decoder_layers"), count(0), "N, decoder layers", MATCH, architecture=True
    ),
    Key(
        "model.dropout_rate",
        _by_size("dropout_rate"),
        fraction(),
        "probability, P_drop on sublayer outputs and embedding + PE sums",
        MAY_CHANGE,
    ),
    Key(
        "model.attention_dropout_rate",
        0.0,
        fraction(),
        "probability, on attention weights (not in the paper)",
        MAY_CHANGE,
    ),
    Key(
        "model.ffn_dropout_rate",
        0.0,
        fraction(),
        "probability, on the FFN hidden activation (not in the paper)",
        MAY_CHANGE,
    ),
    Key(
        "model.activation",
        "relu",
        choice(ACTIVATIONS),
        "FFN activation: relu (paper), gelu, swiglu (gated), swish (SiLU, not gated: Marian's)",
        MATCH,
        architecture=True,
    ),
    Key("model.norm", "layernorm", choice(NORMS), "layernorm (paper) or rmsnorm", MATCH, architecture=True),
    Key(
        "model.norm_position",
        "post",
        choice(NORM_POSITIONS),
        "post: LayerNorm(x + Sublayer(x)) (paper); pre: x + Sublayer(LayerNorm(x))",
        MATCH,
        architecture=True,
    ),
    Key("model.norm_epsilon", 1e-6, positive(), "added to the variance inside the norm", MAY_CHANGE, architecture=True),
    Key(
        "model.positional",
        "sinusoidal",
        choice(POSITIONALS),
        "positional encoding: sinusoidal (paper), learned, none",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.sinusoid_layout",
        "interleaved",
        choice(SINUSOID_LAYOUTS),
        "columns of the sinusoidal table: interleaved (paper: PE[p, 2i] = sin, PE[p, 2i+1] = cos), concatenated"
        " (Marian's: the same sines in the first d_model/2 columns, the cosines in the last) or fairseq (sin | cos"
        " halves of the frequencies exp(-ln(10000) i / (d_model/2 - 1)): fairseq's, M2M-100's, NLLB-200's)",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.position_offset",
        0,
        count(0),
        "positions added to every source and target position before the positional encoding (M2M-100, NLLB-200:"
        " 2, fairseq's padding_idx + 1); a learned table then holds model.max_len - offset positions",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.lang_token",
        "none",
        choice(LANG_TOKENS),
        "language tokens of a multilingual model (data.directions): none, source (the target's starts the source),"
        " target (the decoder's first token), source_and_target (target, and the source's own starts the source)",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.language_codes",
        (),
        Entries(
            fields=(Field("code", WORD), Field("id", count(0))),
            text=language_code_from_text,
            noun="language code",
        ),
        "a converted model's language tokens (M2M-100's __en__, NLLB-200's eng_Latn) and their ids, e.g."
        " eng_Latn=256047,ces_Latn=256042; empty = the languages of data.directions take the last ids",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.max_len",
        1024,
        count(1),
        "positions a learned positional embedding holds, tokens",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.share_embeddings",
        True,
        FLAG,
        "one matrix for source and target embeddings (paper 3.4)",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.tie_output",
        True,
        FLAG,
        "the output softmax reuses the target embedding matrix (paper 3.4)",
        MATCH,
        architecture=True,
    ),
    Key(
        "model.final_logits_bias",
        False,
        FLAG,
        "a learned float32 bias [vocab_size] added to the output logits (Marian's); zeros at init",
        MATCH,
        architecture=True,
    ),
    Key("model.dtype", "float32", choice(DTYPES), "computation dtype; parameters stay float32", MAY_CHANGE),
    # Hand-written backward passes of the linear layers, the tied logits projection and the loss, arranged for
    # XLA:CPU (the same gradients as autodiff, fewer transposed copies).
    Key(
        "model.fused_backward",
        "auto",
        choice(FUSED_BACKWARD),
        "hand-written backward passes: auto = on for the CPU backend only",
        MAY_CHANGE,
    ),
    # attention
    Key(
        "attention.impl",
        "xla",
        choice(_attention_impls),
        "ops.attention implementation (auto picks by backend)",
        MAY_CHANGE,
    ),
    Key(
        "attention.window",
        0,
        count(0),
        "local attention window, tokens; 0 = full attention",
        MAY_CHANGE,
        architecture=True,
    ),
    # data
    Key(
        "data.source",
        "text",
        choice(DATA_SOURCES),
        "text (a directory of {split}.{lang} files), multi30k (fetched) or tfds",
        MAY_CHANGE,
    ),
    Key("data.text_dir", "", TEXT, "directory with {split}.{lang} files, for source=text (required by it)", MAY_CHANGE),
    Key("data.tfds_name", "wmt14_translate/de-en", TEXT, "TFDS builder/config, for source=tfds", MAY_CHANGE),
    Key(
        "data.tfds_data_dir",
        "",
        TEXT,
        "TFDS data directory; empty = TFDS's default (~/tensorflow_datasets)",
        MAY_CHANGE,
    ),
    Key("data.tfds_download", True, FLAG, "download and prepare a missing TFDS dataset (needs internet)", MAY_CHANGE),
    Key("data.cache_dir", "", TEXT, "where downloads are kept; empty = ~/.cache/transformer_jax", MAY_CHANGE),
    Key("data.src_lang", "en", NAME, "source language code", MATCH),
    Key("data.tgt_lang", "de", NAME, "target language code", MATCH),
    Key("data.train_split", "train", NAME, "training split, as the source names it", MAY_CHANGE),
    Key("data.valid_split", "valid", NAME, "validation split, as the source names it", MAY_CHANGE),
    Key("data.test_split", "test", NAME, "test split, as the source names it", MAY_CHANGE),
    Key(
        "data.tokenizer_model",
        "",
        TEXT,
        "an existing SentencePiece .model file; empty = train one into the workdir",
        MAY_CHANGE,
    ),
    Key(
        "data.tokenizer_type", "unigram", choice(TOKENIZER_TYPES), "SentencePiece model type", MATCH, architecture=True
    ),
    Key(
        "data.tokenizer",
        "spm",
        choice(TOKENIZERS),
        "spm (joint, trained here), marian or fairseq (a converted M2M-100 / NLLB-200 model's)",
        MATCH,
        architecture=True,
    ),
    Key("data.target_lang", "", TEXT, "a >>lang<< token starts every source; empty = none", MATCH),
    Key(
        "data.directions",
        (),
        Entries(each=DIRECTION, noun="direction"),
        "directions SRC-TGT of the multi-way data.text_dir trained by one model, or all, or LANG-centric (to and from"
        " LANG); empty = the one pair data.src_lang-data.tgt_lang",
        MATCH,
    ),
    Key(
        "data.add_languages",
        (),
        Entries(each=NAME, noun="language"),
        "languages a fine-tuning run (train.init_from) adds to its source: one embedding row and language code each,"
        " after the source's ids (training/add_languages.py); a code (slk_Latn, __sk__, a folder suffix) or a name",
        MATCH,
    ),
    Key(
        "data.direction_lines",
        (),
        Entries(
            fields=(Field("direction", DIRECTION), Field("lines", count(1))),
            text=direction_lines_from_text,
            noun="direction limit",
        ),
        "a direction of data.directions trained on the first LINES lines only (a low-resource direction), e.g."
        " en-cs=3000,cs-en=3000; the others: every line",
        MATCH,
    ),
    Key(
        "data.temperature",
        1.0,
        positive(),
        "directions are drawn with probability proportional to pairs^(1/T): 1 = by size, larger = flatter",
        MATCH,
    ),
    Key(
        "data.tokenizer_sample_sentences",
        1_000_000,
        count(1),
        "sentences (both sides) sampled to train the tokenizer",
        MAY_CHANGE,
    ),
    Key(
        "data.store",
        True,
        FLAG,
        "tokenize the training split once into memory-mapped files (False: in memory at every start)",
        MAY_CHANGE,
    ),
    Key(
        "data.corpora",
        (),
        Entries(
            fields=(
                Field("name", IDENTIFIER),
                Field("kind", choice(CORPUS_KINDS)),
                Field("where", NAME),
                Field("weight", positive()),
                Field("tag", WORD, default=""),
            ),
            text=corpus_from_text,
            together=files_pair,
            noun="corpus",
        ),
        "training corpora mixed by weight (the probability of each next pair); kind text (where: a {split}.{lang}"
        " directory), tfds (a builder) or files (SRC_FILE+TGT_FILE); the tag starts each source; empty = data.source",
        MATCH,
    ),
    Key("data.store_dir", "", TEXT, "directory of the tokenized store; empty = the tokenizer's directory", MAY_CHANGE),
    # The batches a saved iterator position stands for depend on these: they must match on resume.
    Key("data.batching", "pack", choice(BATCHINGS), "pack, bucket or pad", MATCH),
    Key("data.batch_size", 64, count(1), "rows per batch, summed over devices (pack, pad)", MATCH),
    Key(
        "data.tokens_per_batch",
        4096,
        count(1),
        "token slots per side per batch (rows x row length), summed over devices (bucket)",
        MATCH,
    ),
    Key(
        "data.batch_window",
        8192,
        count(1),
        "examples per host grouped at once by pack (first-fit) and bucket (length sort)",
        MATCH,
    ),
    Key(
        "data.max_len",
        64,
        count(2),
        "tokens per side, EOS included: the row length of pack/pad and the training length filter",
        MATCH,
    ),
    Key(
        "data.eval_max_len",
        256,
        count(2),
        "tokens per source sentence at evaluation, EOS included; longer ones are truncated and counted",
        MAY_CHANGE,
    ),
    Key("data.shuffle_seed", 0, count(0, high=SEED_LIMIT), "seed of the deterministic shuffle", MATCH),
    # opt
    Key("opt.optimizer", "adam", choice(OPTIMIZERS), "adam or adamw", MATCH),
    Key("opt.b1", 0.9, fraction(), "Adam beta1 (paper)", MAY_CHANGE),
    Key("opt.b2", 0.98, fraction(), "Adam beta2 (paper)", MAY_CHANGE),
    Key("opt.eps", 1e-9, positive(), "Adam epsilon (paper)", MAY_CHANGE),
    Key("opt.weight_decay", 0.0, at_least_zero(), "decoupled weight decay per step, for adamw", MAY_CHANGE),
    Key(
        "opt.schedule",
        "paper",
        choice(SCHEDULES),
        "paper: d_model^-0.5 * min(step^-0.5, step * warmup^-1.5); rsqrt, cosine, constant",
        MAY_CHANGE,
    ),
    Key(
        "opt.learning_rate",
        lambda size: size.d_model**-0.5,
        positive(),
        "peak learning-rate multiplier (paper: d_model^-0.5); for cosine/constant the peak rate",
        MAY_CHANGE,
    ),
    Key("opt.warmup_steps", 4000, count(0), "steps of linear warmup", MAY_CHANGE),
    # The optimizer state holds moments of the trained parameters only: another set cannot restore it.
    Key(
        "opt.freeze",
        (),
        Entries(each=REGEX),
        "regexes (a tuple, or comma-joined); parameters whose path (e.g. encoder_layers/0/ffn/w1/kernel) one matches"
        " stay fixed; empty = train all",
        MATCH,
    ),
    # Low-rank adapters on a frozen base (model/lora.py): the adapters and their moments are the optimizer's state.
    Key(
        "opt.lora_rank",
        0,
        count(0),
        "r, the rank of each LoRA adapter (A [in, r], B [r, out]) trained on the frozen train.init_from base; 0 = off",
        MATCH,
    ),
    Key("opt.lora_alpha", 8.0, positive(), "LoRA scale numerator: each update s A B has s = alpha / rank", MATCH),
    Key(
        "opt.lora_targets",
        ("q", "v"),
        Entries(each=choice(LORA_TARGETS)),
        f"weights that get an adapter, a tuple or comma-joined, from {list(LORA_TARGETS)} (ffn: every feed-forward"
        " linear layer; embed: the embedding tables, and with them the tied output projection)",
        MATCH,
    ),
    Key(
        "opt.clip_grad_norm",
        0.0,
        at_least_zero(),
        "global gradient norm clipping threshold; 0 = no clipping",
        MAY_CHANGE,
    ),
    # train
    Key("train.seed", 0, count(0, high=SEED_LIMIT), "seed of parameter init and dropout", MAY_CHANGE),
    Key("train.num_steps", 100_000, count(1), "optimizer steps", MAY_CHANGE),
    # Which parameters the run started from: a restart names the same source (and never reads it again).
    Key(
        "train.init_from",
        "",
        TEXT,
        "a workdir whose checkpoint's model parameters start this run (fine-tuning); empty = random parameters",
        MATCH,
    ),
    Key("train.init_step", "latest", NAME, "checkpoint of train.init_from: latest, best, or a step number", MATCH),
    Key(
        "train.source_directions",
        (),
        Entries(each=DIRECTION, noun="direction"),
        "the directions train.init_from's chain of sources trained (their data.directions and their own"
        " train.source_directions), written by the run from its source; the language matrix counts them as supervised",
        MATCH,
    ),
    Key("train.new_language_init", "mean", NAME, "added rows start as: mean of the code rows, or a code's row", MATCH),
    Key("train.grad_accum_steps", 1, count(1), "micro-batches per optimizer step (the same global batch)", MAY_CHANGE),
    Key("train.label_smoothing", 0.1, fraction(), "epsilon_ls (paper)", MAY_CHANGE),
    Key("train.log_every", 100, count(1), "steps between metric logs", MAY_CHANGE),
    Key("train.eval_every", 1000, count(0), "steps between validation-loss evaluations; 0 = never", MAY_CHANGE),
    Key("train.bleu_every", 0, count(0), "steps between validation BLEU evaluations; 0 = never", MAY_CHANGE),
    Key("train.bleu_sentences", 200, count(1), "validation sentences decoded for BLEU during training", MAY_CHANGE),
    Key(
        "train.select_metric",
        "valid_loss",
        choice(SELECT_METRICS),
        "validation score that ranks checkpoints (ckpt.keep_best) and early stopping; loss and ter: lower is better;"
        " bleu/chrf/chrfpp/ter decode the first train.bleu_sentences at every train.eval_every",
        MAY_CHANGE,
    ),
    Key(
        "train.early_stop_patience",
        0,
        count(0),
        "validations without improvement of train.select_metric before the run stops; 0 = never stop early",
        MAY_CHANGE,
    ),
    Key(
        "train.mesh",
        "data",
        choice(_mesh_modes),
        "data (replicated parameters) or fsdp (parameters sharded over the data axis)",
        MAY_CHANGE,
    ),
    Key(
        "train.peak_flops",
        0.0,
        at_least_zero(),
        "FLOP/s of one device, for MFU and --dry_run; 0 = a matmul peak measured once per kind of machine (kept in"
        " the compilation cache)",
        MAY_CHANGE,
    ),
    Key(
        "train.assumed_mfu",
        0.4,
        fraction(low_open=True, high_open=False),
        "fraction of peak FLOP/s assumed by --dry_run's time estimate",
        MAY_CHANGE,
    ),
    Key(
        "train.estimate_devices",
        0,
        count(0),
        "devices assumed by --dry_run's time estimate; 0 = the devices present",
        MAY_CHANGE,
    ),
    Key("train.max_nonfinite_steps", 10, count(1), "consecutive non-finite updates before the run stops", MAY_CHANGE),
    Key(
        "train.trackers",
        ("tensorboard",),
        Entries(each=choice(tuple(TRACKERS))),
        f"experiment trackers beside metrics.jsonl (always written), a tuple or comma-joined, from {list(TRACKERS)}",
        MAY_CHANGE,
    ),
    Key(
        "train.tracker_group",
        "",
        TEXT,
        "W&B group and MLflow experiment of the run (the sweep sets its directory's name); empty = no W&B group,"
        " MLflow experiment transformer_jax",
        MAY_CHANGE,
    ),
    # eval
    Key("eval.beam_size", 4, count(1), "beams", MAY_CHANGE),
    Key("eval.alpha", 0.6, at_least_zero(), "length penalty exponent", MAY_CHANGE),
    Key(
        "eval.max_extra_len",
        50,
        count(1),
        "tokens beyond the input length: the maximum output length (paper)",
        MAY_CHANGE,
    ),
    Key(
        "eval.max_len",
        0,
        count(0),
        "most output tokens, EOS included, whatever the input length (beside eval.max_extra_len, the smaller"
        " applies); 0 = no cap",
        MAY_CHANGE,
    ),
    Key(
        "eval.average_last", 5, count(1), "checkpoints averaged for the final model (paper: 5 base, 20 big)", MAY_CHANGE
    ),
    Key("eval.batch_size", 64, count(1), "sentences per decoding batch", MAY_CHANGE),
    Key(
        "eval.extra_valid",
        (),
        Entries(
            fields=(Field("name", IDENTIFIER), Field("text_dir", NAME), Field("split", NAME, default="valid")),
            text=valid_set_from_text,
            noun="validation set",
        ),
        "validation sets of {split}.{lang} files reported beside data.valid_split, never selecting; empty = none",
        MAY_CHANGE,
    ),
    # ckpt
    Key("ckpt.every_steps", 1000, count(1), "steps between checkpoints", MAY_CHANGE),
    Key("ckpt.keep", 20, count(1), "checkpoints kept (enough for averaging)", MAY_CHANGE),
    Key(
        "ckpt.keep_best",
        0,
        count(0),
        "checkpoints with the best train.select_metric kept besides the last ckpt.keep; 0 = none",
        MAY_CHANGE,
    ),
    Key("ckpt.async_save", True, FLAG, "save in the background", MAY_CHANGE),
)

BY_NAME: dict[str, Key] = {key.name: key for key in KEYS}
RULES: dict[str, Rule | Entries] = {key.name: key.rule for key in KEYS}
LISTS: tuple[str, ...] = tuple(key.name for key in KEYS if isinstance(key.rule, Entries))  # list-valued keys
MUST_MATCH: tuple[str, ...] = tuple(key.name for key in KEYS if key.resume == MATCH)
ARCHITECTURE: tuple[str, ...] = tuple(key.name for key in KEYS if key.architecture)
GROUPS = ("model", "attention", "data", "opt", "train", "eval", "ckpt")


def group(name: str, size: Size | None = None) -> ml_collections.ConfigDict:
    """The defaults of group `name` (model, data, ...) as an unlocked ConfigDict; `size` gives the size-dependent
    ones (model, opt)."""
    values = ml_collections.ConfigDict()
    for key in KEYS:
        prefix, _, leaf = key.name.rpartition(".")
        if prefix == name:
            if callable(key.default) and size is None:
                raise ValueError(f"config key {key.name}: its default depends on the model size; pass one")
            values[leaf] = key.default_for(size)
    if not values:
        raise ValueError(f"no config group {name!r}; the groups are {list(GROUPS)}")
    return values


def size_row(size: str) -> Size:
    if size not in SIZES:
        raise ConfigError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    return SIZES[size]


def base_config(size: str) -> ml_collections.ConfigDict:
    """Every group with its defaults for a model size; config files override and then lock."""
    config = ml_collections.ConfigDict()
    config.size = size
    row = size_row(size)
    for name in GROUPS:
        config[name] = group(name, row)
    return config
