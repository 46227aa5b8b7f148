"""What every command line shares: absl flags whose errors are one line, and `UserError` caught around main.

A command-line mistake (an unknown or malformed flag, a missing required one, a config file that does not exist,
does not parse or whose get_config fails, a --config.KEY override of a key the config lacks) ends the program with
one line `prog: error: message` on stderr, the format of `exit_on_user_error`, and exit status 2. Without
this, absl adds a help hint, and ml_collections.config_flags prints the config file's whole traceback or, for a
missing file, fails with a traceback on first access of the config. Config files are loaded by
`checks.get_config`, the loader every command shares. A list-valued key (a tuple) also takes one unquoted
comma-joined value, which its rule splits (`--config.data.corpora=real=text:DIR:1,bt=files:SRC+TGT:1:<BT>`).
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from absl import app, flags
from ml_collections import config_flags
from ml_collections.config_flags.config_flags import ConfigFileFlagParser, is_config_flag
from ml_collections.config_flags.tuple_parser import TupleParser

from transformer_jax import runtime
from transformer_jax.config import checks
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
    """config_flags' parser of a config-file flag with the one loader (checks.get_config) underneath: a file
    that is missing, does not parse or whose get_config raises is a ConfigError line naming the flag, the file and
    the line, raised while the flags are parsed (config_flags would keep a missing file's error until the config is
    first read, and print the traceback of any other)."""

    def parse(self, path):
        try:
            config = checks.get_config(path)
        except ConfigError as e:  # named by its file and line already, or (a missing file) by the flag's value
            where = "" if str(e).startswith(checks.split_spec(path)[0]) else f" {path}"
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
