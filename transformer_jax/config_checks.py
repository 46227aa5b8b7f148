"""What a run is given, checked before any work: every config value against one table, and the workdir.

`RULES` maps every leaf of the config (configs/common.py) to what it may hold: a type, a range or a set of choices,
and its unit. `validate(config)` checks every leaf against it, refuses a leaf with no rule (a key no code reads,
most often a misspelling in a config file), and then the rules between keys (`check_model`, `check_opt`). It is
called once by train.py, by the sweep for every variant and by evaluate.py for a given --config; TransformerSpec
and the optimiser call the same checks, so there is one source for each rule. A failure is one ConfigError line
naming the key, the value and what is allowed.

This module imports no JAX at import time: the choice sets defined by a registry elsewhere (attention
implementations, mesh modes) are read from there when a config is checked.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import pathlib
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from transformer_jax.errors import ConfigError

# Choice sets of string-valued keys whose implementation has no registry of its own; the modules that dispatch on
# them import these (model/spec.py, training/optim.py).
ACTIVATIONS = ("relu", "gelu", "swiglu")
NORMS = ("layernorm", "rmsnorm")
NORM_POSITIONS = ("post", "pre")
POSITIONALS = ("sinusoidal", "learned", "none")
DTYPES = ("float32", "bfloat16", "float16")
FUSED_BACKWARD = ("auto", "on", "off")
SCHEDULES = ("paper", "rsqrt", "cosine", "constant")
OPTIMIZERS = ("adam", "adamw")
DATA_SOURCES = ("text", "multi30k", "tfds")
BATCHINGS = ("pack", "bucket", "pad")
TOKENIZER_TYPES = ("unigram", "bpe")
SEED_LIMIT = 2**32


def _attention_impls() -> list[str]:
    from transformer_jax import ops  # registers every implementation on import

    return sorted(ops.IMPLEMENTATIONS)


def _mesh_modes() -> list[str]:
    from transformer_jax.sharding import MESH_MODES

    return list(MESH_MODES)


@dataclasses.dataclass(frozen=True)
class Rule:
    """What one config key may hold. `low`/`high` bound numbers (inclusive unless *_open); `choices` lists strings
    (or returns them, for a registry); `unit` says what the number counts, for the error message."""

    kind: type
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    choices: tuple[str, ...] | Callable[[], Iterable[str]] | None = None
    nonempty: bool = False
    unit: str = ""

    def allowed(self) -> str:
        if self.choices is not None:
            return f"one of {list(self.options())}"
        if self.kind is bool:
            return "True or False"
        if self.kind is str:
            return "a non-empty string" if self.nonempty else "a string"
        noun = "an integer" if self.kind is int else "a number"
        if self.low is not None and self.high is not None:
            left, right = "(" if self.low_open else "[", ")" if self.high_open else "]"
            text = f"in {left}{_num(self.low)}, {_num(self.high)}{right} ({noun}"
        elif self.low == 0 and self.low_open or self.low == 1 and self.kind is int:
            text = f"positive ({noun} {'> 0' if self.low_open else '>= 1'}"
        elif self.low is not None:
            text = f"{'>' if self.low_open else '>='} {_num(self.low)} ({noun}"
        else:
            text = f"{noun} ("
        return text + (f", {self.unit})" if self.unit else ")")

    def options(self) -> tuple[str, ...]:
        return tuple(self.choices()) if callable(self.choices) else tuple(self.choices or ())

    def check(self, key: str, value: Any, name: str | None = None) -> None:
        """ConfigError unless `value` is allowed; `name` is how the user set it (default: `config key KEY`)."""
        name = name or f"config key {key}"
        if self.choices is not None:
            if value not in self.options():
                raise ConfigError(f"{name}: unknown value {value!r}; choose one of {list(self.options())}")
            return
        if self.kind is bool:
            ok = isinstance(value, bool)
        elif self.kind is str:
            ok = isinstance(value, str) and (bool(value) or not self.nonempty)
        elif isinstance(value, bool) or not isinstance(value, int if self.kind is int else (int, float)):
            ok = False
        else:
            ok = (
                (self.kind is int or math.isfinite(value))
                and (self.low is None or (value > self.low if self.low_open else value >= self.low))
                and (self.high is None or (value < self.high if self.high_open else value <= self.high))
            )
        if not ok:
            wrong_type = isinstance(value, bool) is not (self.kind is bool) or not isinstance(value, (self.kind, int))
            got = f"{value!r} ({type(value).__name__})" if wrong_type else repr(value)
            raise ConfigError(f"{name}: must be {self.allowed()}, got {got}")


def _num(x: float) -> str:
    return str(int(x)) if float(x).is_integer() and abs(x) < 1e15 else repr(x)


def count(low: int = 1, unit: str = "", high: int | None = None) -> Rule:
    return Rule(int, low=low, high=high, high_open=high is not None, unit=unit)


def positive(unit: str) -> Rule:
    return Rule(float, low=0, low_open=True, unit=unit)


def fraction(unit: str, low_open: bool = False, high_open: bool = True) -> Rule:
    return Rule(float, low=0, high=1, low_open=low_open, high_open=high_open, unit=unit)


def choice(options: tuple[str, ...] | Callable[[], Iterable[str]]) -> Rule:
    return Rule(str, choices=options)


FLAG, TEXT, NAME = Rule(bool), Rule(str), Rule(str, nonempty=True)

# Every leaf of the config: configs/common.py, where each key's comment says what it does.
RULES: dict[str, Rule] = {
    "size": NAME,  # label of the model size the config started from (configs/common.py SIZES)
    # model
    "model.vocab_size": count(1, "tokens in the joint vocabulary"),
    "model.d_model": count(1, "width of the residual stream"),
    "model.num_heads": count(1, "attention heads per layer"),
    "model.num_kv_heads": count(0, "key/value heads; 0 = num_heads"),
    "model.qk_head_dim": count(0, "d_k per head; 0 = d_model / num_heads"),
    "model.v_head_dim": count(0, "d_v per head; 0 = d_model / num_heads"),
    "model.d_ff": count(1, "inner width of the feed-forward network"),
    "model.num_encoder_layers": count(0, "encoder layers"),
    "model.num_decoder_layers": count(0, "decoder layers"),
    "model.dropout_rate": fraction("probability"),
    "model.attention_dropout_rate": fraction("probability"),
    "model.ffn_dropout_rate": fraction("probability"),
    "model.activation": choice(ACTIVATIONS),
    "model.norm": choice(NORMS),
    "model.norm_position": choice(NORM_POSITIONS),
    "model.norm_epsilon": positive("added to the variance"),
    "model.positional": choice(POSITIONALS),
    "model.max_len": count(1, "positions, tokens"),
    "model.share_embeddings": FLAG,
    "model.tie_output": FLAG,
    "model.dtype": choice(DTYPES),
    "model.fused_backward": choice(FUSED_BACKWARD),
    # attention
    "attention.impl": choice(_attention_impls),
    "attention.window": count(0, "tokens; 0 = full attention"),
    # data
    "data.source": choice(DATA_SOURCES),
    "data.text_dir": TEXT,
    "data.tfds_name": TEXT,
    "data.tfds_data_dir": TEXT,
    "data.tfds_download": FLAG,
    "data.cache_dir": TEXT,
    "data.src_lang": NAME,
    "data.tgt_lang": NAME,
    "data.train_split": NAME,
    "data.valid_split": NAME,
    "data.test_split": NAME,
    "data.tokenizer_model": TEXT,
    "data.tokenizer_type": choice(TOKENIZER_TYPES),
    "data.tokenizer_sample_sentences": count(1, "sentences"),
    "data.store": FLAG,
    "data.store_dir": TEXT,
    "data.batching": choice(BATCHINGS),
    "data.batch_size": count(1, "rows per batch, summed over devices"),
    "data.tokens_per_batch": count(1, "token slots per side per batch"),
    "data.batch_window": count(1, "examples grouped at once"),
    "data.max_len": count(2, "tokens per side, EOS included"),
    "data.eval_max_len": count(2, "tokens per source sentence, EOS included"),
    "data.shuffle_seed": count(0, "seed", high=SEED_LIMIT),
    # opt
    "opt.optimizer": choice(OPTIMIZERS),
    "opt.b1": fraction("Adam beta1"),
    "opt.b2": fraction("Adam beta2"),
    "opt.eps": positive("Adam epsilon"),
    "opt.weight_decay": Rule(float, low=0, unit="decoupled weight decay per step"),
    "opt.schedule": choice(SCHEDULES),
    "opt.learning_rate": positive("peak learning-rate multiplier"),
    "opt.warmup_steps": count(0, "steps of linear warmup"),
    "opt.clip_grad_norm": Rule(float, low=0, unit="global gradient norm; 0 = no clipping"),
    # train
    "train.seed": count(0, "seed", high=SEED_LIMIT),
    "train.num_steps": count(1, "optimizer steps"),
    "train.grad_accum_steps": count(1, "micro-batches per optimizer step"),
    "train.label_smoothing": fraction("epsilon_ls"),
    "train.log_every": count(1, "steps"),
    "train.eval_every": count(0, "steps; 0 = never"),
    "train.bleu_every": count(0, "steps; 0 = never"),
    "train.bleu_sentences": count(1, "sentences"),
    "train.mesh": choice(_mesh_modes),
    "train.peak_flops": Rule(float, low=0, unit="FLOP/s of one device; 0 = measure"),
    "train.assumed_mfu": fraction("fraction of peak FLOP/s", low_open=True, high_open=False),
    "train.estimate_devices": count(0, "devices; 0 = the devices present"),
    "train.max_nonfinite_steps": count(1, "consecutive non-finite updates"),
    # eval
    "eval.beam_size": count(1, "beams"),
    "eval.alpha": Rule(float, low=0, unit="length penalty exponent"),
    "eval.max_extra_len": count(1, "tokens beyond the input length"),
    "eval.average_last": count(1, "checkpoints"),
    "eval.batch_size": count(1, "sentences per decoding batch"),
    # ckpt
    "ckpt.every_steps": count(1, "steps between checkpoints"),
    "ckpt.keep": count(1, "checkpoints"),
    "ckpt.async_save": FLAG,
}


def leaves(config: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted key, value) of every leaf of a (nested) ConfigDict or dict."""
    for key, value in config.items():
        if hasattr(value, "items"):  # a ConfigDict group (not a collections Mapping) or a dict
            yield from leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


def check_value(key: str, value: Any) -> None:
    """One leaf against its rule; a key with no rule is a key no code reads."""
    rule = RULES.get(key)
    if rule is None:
        close = difflib.get_close_matches(key, RULES, n=1)
        hint = f"did you mean {close[0]}? " if close else ""
        raise ConfigError(f"config key {key}: unknown key, no code reads it; {hint}fix its name or remove it")
    rule.check(key, value)


def check_model(values: Mapping[str, Any]) -> None:
    """The `model.*` and `attention.*` keys (dotted key -> value): each against its rule, then the rules between
    them. TransformerSpec calls this with its fields, so a spec built in code is held to the same rules."""
    for key, value in values.items():
        check_value(key, value)
    m = {key.removeprefix("model."): value for key, value in values.items()}
    d_model, heads, kv_heads = m["d_model"], m["num_heads"], m["num_kv_heads"]
    if (m["qk_head_dim"] == 0 or m["v_head_dim"] == 0) and d_model % heads:
        raise ConfigError(
            f"config key model.num_heads: d_model={d_model} is not divisible by num_heads={heads}; "
            "change one, or set model.qk_head_dim and model.v_head_dim explicitly"
        )
    if kv_heads and heads % kv_heads:
        raise ConfigError(
            f"config key model.num_kv_heads: num_heads={heads} is not a multiple of num_kv_heads={kv_heads}"
        )
    if m["positional"] == "sinusoidal" and d_model % 2:
        raise ConfigError(
            f"config key model.d_model: the sinusoidal positional encoding needs an even d_model, got {d_model}"
        )
    if m["attention_dropout_rate"] > 0 and m["attention.impl"] != "xla":
        raise ConfigError(
            f"config key model.attention_dropout_rate: attention-weight dropout needs the materialised weights of "
            f"attention.impl='xla', not {m['attention.impl']!r}; set it to 0 or use xla"
        )


def check_opt(opt: Mapping[str, Any]) -> None:
    """The `opt` group: each key against its rule, then the rules between keys. The optimiser calls this too."""
    for key, value in opt.items():
        check_value(f"opt.{key}", value)
    if opt["optimizer"] == "adam" and opt["weight_decay"]:
        raise ConfigError(
            f"config key opt.weight_decay: Adam has no decoupled weight decay (got {opt['weight_decay']}); "
            "use opt.optimizer=adamw or set it to 0"
        )


def validate(config: Mapping[str, Any]) -> None:
    """Every leaf of a full config against RULES, then the rules between keys; ConfigError on the first failure."""
    values = dict(leaves(config))
    for key, value in values.items():
        check_value(key, value)
    missing = sorted(set(RULES) - set(values))
    if missing:
        raise ConfigError(f"config lacks keys {missing}; start from configs/common.py base_config")
    check_model({k: v for k, v in values.items() if k.startswith(("model.", "attention."))})
    check_opt(config["opt"])
    if values["model.positional"] == "learned" and values["data.max_len"] > values["model.max_len"]:
        raise ConfigError(
            f"config key data.max_len: {values['data.max_len']} tokens per side exceed the {values['model.max_len']} "
            "positions of the learned positional embedding (model.max_len); lower one or raise the other"
        )


def check_workdir(path: str | os.PathLike) -> pathlib.Path:
    """Makes the workdir if needed and checks that files can be written there; ConfigError (one line) otherwise.

    Run before any work, so that a run does not fail after minutes of setup at its first checkpoint.
    """
    workdir = pathlib.Path(path)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file, not a directory; give a directory (it is made if missing)")
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=workdir):
            pass
    except OSError as e:
        raise ConfigError(
            f"--workdir {workdir}: cannot write there ({e.strerror or e}); give a writable directory"
        ) from e
    return workdir
