"""Loading a config file (`configs/<file>.py[:arg]`): the one loader of train.py, evaluate.py --config, the sweep
and every other command line (cli.parse_flags puts it under each config-file flag).

A config file that does not parse, fails while it is imported, or whose get_config(arg) raises is one ConfigError
line: the file and line, the exception's type and its own message; for an error raised deeper (a helper in
configs/common.py), the line of the config file that called it and where it was raised. No traceback, because
the fault is the user's file, not this code.
"""

from __future__ import annotations

import importlib.util
import traceback
import types
from pathlib import Path
from typing import Any

from transformer_jax.errors import ConfigError


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
