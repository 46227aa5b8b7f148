"""benchmarks/reading_path.py counts the modules whose functions a command calls, not those it only imports."""

import json
import pathlib
import subprocess
import sys
import textwrap

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_only_modules_whose_functions_run_after_the_imports_count(tmp_path):
    # Importing the schema runs rules' functions (every Key is built at import): a reader never walks through them.
    # A fresh process, so that the imports happen under the profiler.
    script = tmp_path / "script.py"
    script.write_text(
        textwrap.dedent(
            """
            from transformer_jax.config import schema

            def main():
                return schema.size_row("tiny")

            main()
            """
        )
    )
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.reading_path", "--", str(script)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    report = json.loads(out.stdout.splitlines()[-1])
    assert report["modules"] == ["transformer_jax.config.schema"] and report["count"] == 1
