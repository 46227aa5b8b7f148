"""The modules a reader walks through when following one command's calls: every module of the package whose
functions the command calls, found by running it under a profiler.

    python -m benchmarks.reading_path -- train.py --config configs/multi30k.py:size=small --workdir W ...
    python -m benchmarks.reading_path -- evaluate.py --workdir W --split test

Calls made while a module is being imported (decorators, registrations) do not count: a reader who follows the
calls from main does not walk through them. Modules entered only as a class's body, or a dataclass's generated
methods, do not count either. Prints one JSON line: the command, the count and the module names. The import closure
(`python3 ../shared/tools/closure.py train.py evaluate.py`) counts what the command imports; this counts what it runs.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any

PACKAGE = Path(__file__).resolve().parents[1] / "transformer_jax"


def module_name(path: str) -> str:
    """transformer_jax/training/loop.py -> transformer_jax.training.loop (an __init__ keeps its name)."""
    return ".".join(Path(path).relative_to(PACKAGE.parent).with_suffix("").parts)


def entered_modules(script: str, args: list[str]) -> list[str]:
    """Runs `script` with `args` as its command line (as `python script args` would) and returns the sorted names of
    the package modules whose functions it called, outside imports."""
    script_path = str(Path(script).resolve())
    package = str(PACKAGE) + os.sep
    entered: set[str] = set()

    def importing(frame: FrameType) -> bool:
        """Whether the nearest module body that leads to this call is another module's (an import) than the
        script's own."""
        caller = frame.f_back
        while caller is not None:
            if caller.f_code.co_name == "<module>":
                return str(Path(caller.f_code.co_filename).resolve()) != script_path
            caller = caller.f_back
        return False

    def profile(frame: FrameType, event: str, _: Any) -> None:
        if event != "call":
            return
        filename = frame.f_code.co_filename
        if filename.startswith(package) and filename not in entered and frame.f_code.co_name != "<module>":
            if not importing(frame):
                entered.add(filename)

    argv = sys.argv
    sys.argv = [script, *args]
    sys.setprofile(profile)
    threading.setprofile(profile)
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
        sys.argv = argv
    return sorted(module_name(f) for f in entered)


def main() -> None:
    args = sys.argv[1:]
    if args[:1] == ["--"]:
        args = args[1:]
    if not args:
        sys.exit("usage: python -m benchmarks.reading_path -- SCRIPT [ARGS...]")
    modules = entered_modules(args[0], args[1:])
    print(json.dumps({"command": " ".join(args), "count": len(modules), "modules": modules}))


if __name__ == "__main__":
    main()
