"""What every command line shares: absl flags whose errors are one line, `UserError` caught around main, and the
config it is given, loaded and checked.

A command-line mistake (an unknown or malformed flag, a missing required one, a config file that does not exist,
does not parse or whose get_config fails, a --config.KEY override of a key the config lacks) ends the program with
one line `prog: error: message` on stderr, the format of `exit_on_user_error`, and exit status 2. Without
this, absl adds a help hint, and ml_collections.config_flags prints the config file's whole traceback or, for a
missing file, fails with a traceback on first access of the config. Config files are loaded by
`get_config`, the loader every command shares. A list-valued key (a tuple) also takes one unquoted
comma-joined value, which its rule splits (`--config.data.corpora=real=text:DIR:1,bt=files:SRC+TGT:1:<BT>`).

The config: the file loaded (`get_config`), then checked before any work, every config value against its key's
rule, and the workdir.

`get_config('configs/<file>.py[:arg]')` is the one loader of train.py, evaluate.py --config, the sweep and every
other command line (cli.parse_flags puts it under each config-file flag). A config file that does not parse, fails
while it is imported, or whose get_config(arg) raises is one ConfigError line: the file and line, the exception's
type and its own message; for an error raised deeper (a helper in configs/common.py), the line of the config file
that called it and where it was raised. No traceback, because the fault is the user's file, not this code.

Each key's rule is written once, with its default, in `schema.KEYS`; `RULES` is that table. `validate(config)`
puts every list-valued key in its tuple form (in place: what the run saves and reads is the tuple), checks every leaf
against its rule, refuses a leaf with no key (a key no code reads, most often a misspelling), then applies the rules
between keys (`check_between`). Every command line that receives a config calls it once, before any work (train.py
and the sweep with training=True, which also finds the trackers' packages). Where a config reaches the library
otherwise, TransformerSpec applies the model's rules (`check_model`) to every model built, and a fine-tuning run the
rules between keys to its config merged with its source's architecture. A failure is one ConfigError line naming
the key, the value and what is allowed.
"""

from __future__ import annotations

import contextlib
import difflib
import importlib.util
import os
import sys
import traceback
import types
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

from absl import app, flags
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser, is_config_flag
from ml_collections.config_flags.tuple_parser import TupleParser

from transformer_jax import runtime
from transformer_jax.config.schema import LISTS, RULES, TRACKERS
from transformer_jax.errors import ConfigError, UserError

USAGE_STATUS = 2  # a command line that cannot work: the usage-error status of Unix tools and argparse


def fail(prog: str, message: str, status: int = USAGE_STATUS) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


@contextlib.contextmanager
def exit_on_user_error(prog: str, status: int = 1) -> Iterator[None]:
    """Inside: a UserError (errors.py) becomes one line `prog: error: message` on stderr and exit `status`."""
    try:
        yield
    except UserError as e:
        fail(prog, str(e), status)


def _one_line(error: BaseException) -> str:
    """config_flags puts the config file's traceback into its message; the last line of that names the error."""
    message: object = error
    while isinstance(message, KeyError | AttributeError) and message.args:  # str(KeyError) would quote its message
        message = message.args[0]
    text = str(message)
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    if "Traceback (most recent call last):" in text:
        return lines[-1]
    return " ".join(lines)


class _ConfigFileParser(ConfigFileFlagParser):
    """config_flags' parser of a config-file flag with the one loader (get_config) underneath: a file
    that is missing, does not parse or whose get_config raises is a ConfigError line naming the flag, the file and
    the line, raised while the flags are parsed (config_flags would keep a missing file's error until the config is
    first read, and print the traceback of any other)."""

    def parse(self, path):
        try:
            config = get_config(path)
        except ConfigError as e:  # named by its file and line already, or (a missing file) by the flag's value
            where = "" if str(e).startswith(split_spec(path)[0]) else f" {path}"
            raise ConfigError(f"--{self.name}{where}: {e}") from None
        if self._lock_config and callable(getattr(config, "lock", None)):
            config.lock()
        return config


def _use_the_config_loader(flag_values: flags.FlagValues) -> None:
    """Puts _ConfigFileParser under every config-file flag (DEFINE_config_file) of flag_values."""
    for name in list(flag_values):
        flag = flag_values[name]
        if is_config_flag(flag) and type(flag.parser) is ConfigFileFlagParser:
            flag.parser = _ConfigFileParser(flag.parser.name, getattr(flag.parser, "_lock_config", True))


class _ListParser(TupleParser):
    """ml_collections' parser of an override of a tuple-valued key (a list-valued key, config/rules.py Entries),
    which also takes a value that is no Python literal and holds a comma as the 1-tuple of that text, as it takes
    `--config.train.trackers=tensorboard,wandb`: the key's rule splits it. ml_collections refuses such a value
    (`--config.data.corpora=real=text:DIR:1,bt=files:SRC+TGT:1:<BT>`, `--config.opt.freeze=encoder/.*,src_embed`)."""

    def parse(self, argument: Any) -> tuple:
        try:
            return super().parse(argument)
        except ValueError:
            return (argument,)


HELP_FLAGS = ("-h", "--help", "-help", "--helpshort", "--helpfull")


def parse_flags(
    prog: str, argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS, usage: str | None = None
) -> list[str]:
    """Parses argv (program name first) into flag_values; returns the program name and the positional arguments.

    Every command line gets --compilation_cache here and has the persistent compilation cache turned on (or off)
    before it compiles anything, and runs on the CPU where the host has no accelerator and the user chose no
    platform (runtime.use_cpu_without_accelerators: no plugin's failure to find its chip is printed), and its
    tuple-valued config overrides read by _ListParser (registered with ml_collections, as its API provides).
    `usage`: for a FlagValues of one's own, which lacks absl's help flags, --help prints it and the flags, exit 0.
    """
    runtime.use_cpu_without_accelerators()
    if "compilation_cache" not in flag_values:
        flags.DEFINE_string(
            "compilation_cache",
            None,
            "Directory of compiled programs kept across runs ('off' disables it; default "
            f"${runtime.COMPILE_CACHE_ENV}, else ~/.cache/transformer_jax/xla).",
            flag_values=flag_values,
        )
    if usage is not None and any(arg in HELP_FLAGS for arg in argv[1:]):
        print(f"{usage}\nflags:\n{flag_values.get_help(include_special_flags=False)}")
        sys.exit(0)
    _use_the_config_loader(flag_values)
    config_flags.register_flag_parser_for_type(tuple, _ListParser())  # before the --config.KEY flags are defined
    try:
        rest = flag_values(list(argv))
    except flags.Error as e:
        if isinstance(e.__context__, ConfigError):  # a config file that failed (_ConfigFileParser)
            fail(prog, str(e.__context__))
        fail(prog, _one_line(e))
    except (AttributeError, KeyError) as e:  # a --config.KEY=VALUE override of a key the config does not have
        fail(prog, f"config: {type(e).__name__} {_one_line(e)}")
    runtime.enable_compile_cache(flag_values.compilation_cache)
    _hide_compile_only_cache_reads()
    return rest


def _hide_compile_only_cache_reads() -> None:
    """Hides the one warning jax gives for ahead-of-time compiles for devices this host lacks (train.py --plan,
    accelerators.py): their compile-only client writes its executable to the persistent cache but cannot load one,
    so a second compile of the same program warns "Error reading persistent compilation cache entry ... PjRtCompiler
    must be constructed with a Client to call DeserializeLoadedExecutable" and compiles again, which is the right
    outcome. Every other cache warning (a damaged entry, an unwritable directory) still shows. Kept rather than not
    caching those programs: the cache is one process-wide jax setting, so plan/ would switch it off and back on
    (reopening the cache each time) around every compile-only program, which is more code than this filter."""
    warnings.filterwarnings(
        "ignore",
        message=r"Error reading persistent compilation cache entry .*DeserializeLoadedExecutable",
        category=UserWarning,
    )


def run(main: Callable[[list[str]], Any], prog: str, status: int = 1) -> None:
    """app.run(main) with one-line flag errors, no positional arguments, and main's UserError as one line."""

    def parse(argv: list[str]) -> list[str]:
        rest = parse_flags(prog, argv)
        if len(rest) > 1:
            fail(prog, f"unexpected arguments: {rest[1:]}")
        return rest

    def guarded(argv: list[str]) -> None:
        with exit_on_user_error(prog, status):
            main(argv)

    app.run(guarded, flags_parser=parse)


# -- the config: loaded, then checked ----------------------------------------------------------------------------------


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
    check_special_ids(m)
    if m["source_vocab_size"] not in (0, m["vocab_size"]) and m["share_embeddings"]:
        raise ConfigError(
            f"config key model.source_vocab_size: {m['source_vocab_size']} source rows and {m['vocab_size']} target "
            "rows cannot share one embedding; set model.share_embeddings=False"
        )
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
    if m["positional"] == "sinusoidal" and m["sinusoid_layout"] == "fairseq" and d_model < 4:
        raise ConfigError(
            f"config key model.sinusoid_layout: fairseq's frequencies need d_model >= 4, got {d_model}; "
            "raise model.d_model or choose another layout"
        )
    if m["positional"] == "learned" and m["position_offset"] >= m["max_len"]:
        raise ConfigError(
            f"config key model.position_offset: {m['position_offset']} leaves none of the {m['max_len']} rows of "
            "the learned positional embedding (model.max_len) for position 0; lower it or raise model.max_len"
        )
    if m["attention_dropout_rate"] > 0 and m["attention.impl"] != "xla":
        raise ConfigError(
            f"config key model.attention_dropout_rate: attention-weight dropout needs the materialised weights of "
            f"attention.impl='xla', not {m['attention.impl']!r}; set it to 0 or use xla"
        )


def check_special_ids(m: Mapping[str, Any]) -> None:
    """model.pad_id/eos_id/bos_id/unk_id (keys without `model.`): each a row of the vocabulary; pad, eos and unk
    distinct, bos distinct from unk (it may be pad: Marian's decoder starts from pad; or eos: fairseq's starts from
    `</s>`, and the search stops only when it emits eos, never at its first input)."""
    ids = {f"{f}_id": m[f"{f}_id"] for f in ("pad", "eos", "bos", "unk")}
    for key, value in ids.items():
        if value >= m["vocab_size"]:
            raise ConfigError(
                f"config key model.{key}: {value} is not a row of the vocabulary (model.vocab_size={m['vocab_size']})"
            )
    for a, b in (
        ("pad_id", "eos_id"),
        ("pad_id", "unk_id"),
        ("eos_id", "unk_id"),
        ("bos_id", "unk_id"),
    ):
        if ids[a] == ids[b]:
            raise ConfigError(f"config key model.{b}: equals model.{a} ({ids[a]}); the reserved ids must differ")


def check_init(step: str, init_from: str) -> None:
    """train.init_step: latest, best or a step number, and only with train.init_from."""
    if step not in ("latest", "best") and not step.isdigit():
        raise ConfigError(f"config key train.init_step: must be latest, best or a step number, got {step!r}")
    if step != "latest" and not init_from:
        raise ConfigError(
            f"config key train.init_step: {step!r} names a checkpoint of train.init_from, which is empty; "
            "set train.init_from to the workdir to start from"
        )


def validate(config: Mapping[str, Any], training: bool = False) -> None:
    """Every list-valued key of a full config split into its tuple (in place), every leaf against RULES, then the
    rules between keys; with `training`, the trackers' packages too (training needs them; evaluating, or fine-tuning
    from a run that logged to W&B, does not). ConfigError on the first failure."""
    split_lists(config)
    values = dict(leaves(config))
    for key, value in values.items():
        check_value(key, value)
    missing = sorted(set(RULES) - set(values))
    if missing:
        raise ConfigError(f"config lacks keys {missing}; start from configs/common.py base_config")
    check_between(values)
    if training:
        tracker_packages(values["train.trackers"])


def split_lists(config: Mapping[str, Any]) -> None:
    """Puts every list-valued key of `config` (a ConfigDict or dict) in its tuple form, by the key's rule
    (rules.Entries.split): the form a run saves and every reader takes."""
    for key in LISTS:
        group, _, leaf = key.rpartition(".")
        if group in config and leaf in config[group]:
            value = RULES[key].split(key, config[group][leaf])
            if value != config[group][leaf]:
                config[group][leaf] = value


def check_between(values: Mapping[str, Any]) -> None:
    """The rules between keys of a full config (dotted key -> value) whose leaves were checked: what `validate`
    applies last, and what a fine-tuning run applies to its config merged with its source's architecture."""
    check_model({k: v for k, v in values.items() if k.startswith(("model.", "attention."))})
    if values["opt.optimizer"] == "adam" and values["opt.weight_decay"]:
        raise ConfigError(
            f"config key opt.weight_decay: Adam has no decoupled weight decay (got {values['opt.weight_decay']}); "
            "use opt.optimizer=adamw or set it to 0"
        )
    for key in ("ckpt.keep_best", "train.early_stop_patience"):
        if values[key] and not values["train.eval_every"]:
            raise ConfigError(
                f"config key {key}={values[key]} needs a validation to rank checkpoints by, but train.eval_every=0; "
                f"set train.eval_every > 0 or {key}=0"
            )
    check_init(values["train.init_step"], values["train.init_from"])
    if values["data.add_languages"] and not values["train.init_from"]:
        raise ConfigError(
            f"config key data.add_languages={values['data.add_languages']} adds languages to a trained model, but "
            "train.init_from is empty; set it to the workdir of a multilingual or converted model"
        )
    _check_lora(values)
    _check_languages(values)
    positions = values["model.max_len"] - values["model.position_offset"]  # a learned table's rows from the offset
    if values["model.positional"] == "learned" and values["data.max_len"] > positions:
        raise ConfigError(
            f"config key data.max_len: {values['data.max_len']} tokens per side exceed the {positions} positions of "
            "the learned positional embedding (model.max_len less model.position_offset); lower one or raise the other"
        )


def _check_lora(values: Mapping[str, Any]) -> None:
    """LoRA (opt.lora_rank > 0) trains adapters on a frozen base: a trained one (train.init_from), all of it frozen."""
    rank = values["opt.lora_rank"]
    if not rank:
        return
    if not values["train.init_from"]:
        raise ConfigError(
            f"config key opt.lora_rank={rank} trains adapters on a frozen base, but train.init_from is empty (a random "
            "base would stay random); set train.init_from to the workdir of a trained or converted model"
        )
    if values["opt.freeze"]:
        raise ConfigError(
            f"config key opt.freeze: with opt.lora_rank={rank} the whole base is frozen and only the adapters train "
            "(choose them with opt.lora_targets); set opt.freeze=() or opt.lora_rank=0"
        )


def _check_languages(values: Mapping[str, Any]) -> None:
    """A multilingual run (data.directions) reads one multi-way text folder with a SentencePiece tokenizer, whose
    language ids follow its pieces (a converted Marian vocabulary has no room after them), or with a converted
    model's tokenizer and its language codes (model.language_codes)."""
    directions, scheme, codes = values["data.directions"], values["model.lang_token"], values["model.language_codes"]
    if not directions:
        if scheme != "none" and not codes:
            raise ConfigError(
                f"config key model.lang_token={scheme!r} needs data.directions (the languages to make tokens for); "
                "set data.directions or model.lang_token=none"
            )
        return
    clashes = {
        "data.source": values["data.source"] != "text",
        "data.corpora": bool(values["data.corpora"]),
        "data.target_lang": bool(values["data.target_lang"]),
        # With codes: a converted model's fairseq tokenizer, or ours whose table data.add_languages wrote out.
        "data.tokenizer": values["data.tokenizer"] not in (("fairseq", "spm") if codes else ("spm",)),
        "eval.extra_valid": bool(values["eval.extra_valid"]),
    }
    for key, clash in clashes.items():
        if clash:
            raise ConfigError(
                f"config key {key}: a multilingual run (data.directions) reads a multi-way folder (data.source=text, "
                "data.text_dir) with a SentencePiece tokenizer (data.tokenizer=spm; fairseq with model.language_codes) "
                "and validates every direction of that folder, without data.corpora, data.target_lang or "
                "eval.extra_valid; change it, or unset data.directions"
            )


def tracker_packages(names: tuple[str, ...]) -> None:
    """ConfigError naming the key for a tracker of train.trackers whose optional package is not installed (found,
    never imported here)."""
    for name in names:
        requirement = TRACKERS[name]
        if requirement and importlib.util.find_spec(requirement.partition("==")[0]) is None:
            raise ConfigError(
                f"config key train.trackers: {name} needs its package, which is not installed: "
                f"pip install {requirement} (or remove {name} from train.trackers)"
            )


def check_workdir(path: str | os.PathLike) -> Path:
    """Makes the workdir if needed and checks that files can be written there, so that a run does not fail at its
    first checkpoint after minutes of setup; ConfigError (one line) otherwise."""
    workdir = Path(path)
    if workdir.exists() and not workdir.is_dir():
        raise ConfigError(f"--workdir {workdir} is a file, not a directory; give a directory (it is made if missing)")
    try:
        return runtime.probe_writable(workdir)
    except OSError as e:
        raise ConfigError(
            f"--workdir {workdir}: cannot write there ({e.strerror or e}); give a writable directory"
        ) from e


# ----------------------------------------------------------------------------------------------------------------
# Loading a config file.


def split_spec(spec: str) -> tuple[str, str | None]:
    """'configs/x.py:size=tiny' -> ('configs/x.py', 'size=tiny'); no ':' -> (spec, None)."""
    path, sep, arg = spec.partition(":")
    return path, arg if sep else None


def load_module(path: str, name: str | None = None) -> types.ModuleType:
    """Imports the config file at `path` as a module of its own (not registered in sys.modules)."""
    file = Path(path)
    if not file.is_file():
        raise ConfigError(f"no such file {path}")
    spec = importlib.util.spec_from_file_location(name or f"config_file_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:  # the file itself: its own line and column
        where = f"{e.filename or path}:{e.lineno}" if e.lineno else str(e.filename or path)
        raise ConfigError(f"{where}: {type(e).__name__}: {e.msg}; fix the config file") from None
    except Exception as e:  # whatever the file raised while it was imported
        raise ConfigError(f"{_where(e, file)}: while importing it: {_what(e)}") from None
    return module


def call(module: types.ModuleType, path: str, function: str, *args: Any) -> Any:
    """module.<function>(*args), for get_config and the sweep's get_sweep; what it raises becomes one ConfigError
    line."""
    fn = getattr(module, function, None)
    if not callable(fn):
        raise ConfigError(f"{path}: defines no {function}(arg)")
    try:
        return fn(*args)
    except Exception as e:  # whatever the user's function raised
        called = f"{function}({', '.join(map(repr, args))})"
        raise ConfigError(f"{_where(e, Path(path))}: {called} raised {_what(e)}") from None


def get_config(spec: str) -> Any:
    """The config of 'path[:arg]': the file loaded, then its get_config(arg) (get_config() without ':', as
    config_flags calls it)."""
    path, arg = split_spec(spec)
    return call(load_module(path), path, "get_config", *([] if arg is None else [arg]))


def _what(e: BaseException) -> str:
    """'Type: message', the message whole on one line (a KeyError's without its quotes)."""
    message = e.args[0] if isinstance(e, KeyError) and e.args else e
    text = " ".join(str(message).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _where(e: BaseException, file: Path) -> str:
    """'FILE:LINE' of the config file's innermost frame in e's traceback, plus ' (raised at OTHER:LINE)' when the
    exception was raised in another file."""
    frames = traceback.extract_tb(e.__traceback__)
    target = file.resolve()
    own = [f for f in frames if _same(f.filename, target)]
    if not own:
        return str(file)
    where = f"{file}:{own[-1].lineno}"
    last = frames[-1]
    if not _same(last.filename, target):
        where += f" (raised at {_short(last.filename)}:{last.lineno})"
    return where


def _same(filename: str, target: Path) -> bool:
    try:
        return Path(filename).resolve() == target
    except OSError:
        return False


def _short(filename: str) -> str:
    """A file name relative to the working directory where it is inside it, else the path as it is."""
    path = Path(filename)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)
