"""What every command line shares: absl flags whose errors are one line, and `UserError` caught around main.

A command-line mistake (an unknown or malformed flag, a missing required one, a config file that does not exist or
whose get_config fails, a --config.KEY override of a key the config lacks) ends the program with one line
`prog: error: message` on stderr, the format of `errors.exit_on_user_error`, and exit status 2. Without this,
absl adds a help hint, and ml_collections.config_flags prints the config file's whole traceback or, for a missing
file, fails with a traceback on first access of the config.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from absl import app, flags
from ml_collections.config_flags.config_flags import is_config_flag

from transformer_jax import compile_cache
from transformer_jax.errors import exit_on_user_error

USAGE_STATUS = 2  # a command line that cannot work: the usage-error status of Unix tools and argparse


def fail(prog: str, message: str, status: int = USAGE_STATUS) -> NoReturn:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    sys.exit(status)


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


def _argument(argv: Sequence[str], name: str) -> str | None:
    """The value given to --name in argv (as --name=value or --name value), if any."""
    for i, arg in enumerate(argv):
        if arg.startswith(f"--{name}="):
            return arg.split("=", 1)[1]
        if arg == f"--{name}" and i + 1 < len(argv):
            return argv[i + 1]
    return None


def _check_config_files(prog: str, argv: Sequence[str], flag_values: flags.FlagValues) -> None:
    """Ends the program if a config file flag names a missing file or one that failed to load.

    config_flags keeps such an error until the config is first read, where it would surface as a traceback.
    """
    for name in list(flag_values):
        flag = flag_values[name]
        if not is_config_flag(flag):
            continue
        spec = _argument(argv, name)
        if spec is not None and not Path(spec.split(":", 1)[0]).is_file():
            fail(prog, f"--{name} {spec}: no such file {spec.split(':', 1)[0]}")
        if flag.value is not None:
            try:
                flag.value.get  # noqa: B018 - the first access raises the deferred load error (OSError)
            except OSError as e:
                fail(prog, f"--{name}: {_one_line(e)}")


HELP_FLAGS = ("-h", "--help", "-help", "--helpshort", "--helpfull")


def parse_flags(
    prog: str, argv: Sequence[str], flag_values: flags.FlagValues = flags.FLAGS, usage: str | None = None
) -> list[str]:
    """Parses argv (program name first) into flag_values; returns the program name and the positional arguments.

    Every command line gets --compilation_cache here and has the persistent compilation cache turned on (or off)
    before it compiles anything. `usage`: for a FlagValues of one's own, which lacks absl's help flags, --help
    prints it and the flags, exit 0.
    """
    if "compilation_cache" not in flag_values:
        flags.DEFINE_string(
            "compilation_cache",
            None,
            f"Directory of compiled programs kept across runs ('off' disables it; default ${compile_cache.ENV}, "
            "else ~/.cache/transformer_jax/xla).",
            flag_values=flag_values,
        )
    if usage is not None and any(arg in HELP_FLAGS for arg in argv[1:]):
        print(f"{usage}\nflags:\n{flag_values.get_help(include_special_flags=False)}")
        sys.exit(0)
    try:
        rest = flag_values(list(argv))
    except flags.Error as e:
        fail(prog, _one_line(e))
    except (AttributeError, KeyError) as e:  # a --config.KEY=VALUE override of a key the config does not have
        fail(prog, f"config: {type(e).__name__} {_one_line(e)}")
    except OSError as e:  # config_flags applied an override to a config file that failed to load
        _check_config_files(prog, argv, flag_values)
        fail(prog, _one_line(e))
    _check_config_files(prog, argv, flag_values)
    compile_cache.enable(flag_values.compilation_cache)
    return rest


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
