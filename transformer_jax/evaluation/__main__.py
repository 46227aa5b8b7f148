"""evaluate.py's command line, also `python -m transformer_jax.evaluation` (both call `run_command`): the flags become
a mode record (command.parse), the library runs it (run.py), and this module writes the files and prints the summary
lines; the JSON report goes to --scores_file (default beside the output), and to stdout with --json.

Every output location is checked before the model is restored, and no output may be an input (under any spelling or
link): the default names are checked once the restored checkpoints name them, before anything is translated.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from absl import flags

from transformer_jax import cli, runtime
from transformer_jax.errors import DiskFullError
from transformer_jax.evaluation import bleu, command, run, significance
from transformer_jax.evaluation.command import (
    Compare,
    Outputs,
    ScorePairs,
    ScoresOnly,
    Translate,
    check_folder_writable,
    check_writable,
    define,
    output_files,
    parse,
    refuse_overwriting_inputs,
    to_json,
    values_of,
    write_json,
    write_lines,
)
from transformer_jax.evaluation.scoring import score_lines

DEFAULT_FOLDER = "eval"  # WORKDIR/eval holds the outputs that have no name given


def evaluate(values: Mapping[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """What evaluate.py does with these flag values (by name; absent: unset): writes the outputs, prints the
    summary, returns the report."""
    mode, outputs = parse(values)
    if isinstance(mode, ScoresOnly | Compare):
        return _no_model(mode, outputs)
    stdin = getattr(mode, "stdin", False)
    for flag, path in output_files(outputs.output_file, outputs.scores_file, stdin).items():
        if path:
            check_writable(path, flag.split(" ")[0])
    folder = Path(mode.model.workdir) / DEFAULT_FOLDER
    if outputs.output_file is None and (not stdin or outputs.scores_file is None):
        kind = "output" if not stdin else "report"
        check_folder_writable(folder, f"--workdir (the default {kind} folder WORKDIR/{DEFAULT_FOLDER})")
    loaded = run.load(mode)
    output_file = outputs.output_file
    if output_file is None and isinstance(mode, ScorePairs):
        output_file = str(folder / f"{loaded.name}.{loaded.tag}.scores.txt")
    elif output_file is None and not stdin:
        output_file = str(folder / f"{run.output_name(mode, loaded)}.txt")
    scores_file = outputs.scores_file or (
        f"{output_file}.json" if output_file else str(folder / f"stdin.{loaded.tag}.json")
    )
    written = {"--output_file": output_file, "--scores_file": scores_file}
    nbest_file = None
    if isinstance(mode, Translate) and (mode.decoding.nbest is not None or mode.decoding.candidates > 1):
        nbest_file = written["--nbest (OUTPUT_FILE.nbest)"] = f"{output_file}.nbest"
    refuse_overwriting_inputs(written, loaded.inputs)
    if isinstance(mode, ScorePairs):
        report, summary = _score(mode, loaded, output_file, progress)
        return _finish(report, scores_file, summary, outputs.json)
    if stdin:
        translation = _stream(mode, loaded, output_file)
    else:
        translation = run.translate(mode, loaded, progress=progress)
        write_lines(output_file, translation.hypotheses)
    report = {**translation.report, "hypotheses_file": output_file}
    summary = [run.lines_summary(report["lines"], report["blank_lines"])]
    if report["scores"] is not None:
        summary.append(bleu.format_scores(report["scores"]))
    if nbest_file:
        write_lines(nbest_file, list(run.nbest_lines(translation.lists)))
        report["search"] = {**report["search"], "nbest_file": nbest_file}
    if not stdin:
        summary.append(f"hypotheses: {output_file}" + (f"; n-best lists: {nbest_file}" if nbest_file else ""))
    # With stdin's translations on stdout, the summary goes to stderr.
    return _finish(report, scores_file, summary, outputs.json, to_stderr=output_file is None)


def _no_model(mode: ScoresOnly | Compare, outputs: Outputs) -> dict[str, Any]:
    if outputs.scores_file:
        check_writable(outputs.scores_file, "--scores_file")
    if isinstance(mode, Compare):
        report = run.compare(mode)
        summary = significance.format_comparison(
            report["comparison"], system_name=mode.hypotheses_file, baseline_name=mode.compare_file
        )
    else:
        report = run.scores_only(mode)
        summary = bleu.format_scores(report)
    return _finish(report, outputs.scores_file, [summary], outputs.json)


def _stream(mode: Translate, loaded: run.Loaded, output_file: str | None) -> run.Translation:
    """stdin, one line at a time: each translation is written (and flushed) as soon as it is ready."""
    # A file is streamed into OUTPUT.partial and renamed when stdin ends: an earlier OUTPUT stays as it was until
    # then, and a run that fails leaves the lines it translated in OUTPUT.partial.
    partial = f"{output_file}.partial" if output_file else None
    if partial:
        Path(partial).parent.mkdir(parents=True, exist_ok=True)
    out = open(partial, "w", encoding="utf-8") if partial else sys.stdout
    results = []
    try:
        for hypothesis, stats in run.stream(mode, loaded, run.stdin_lines()):
            try:
                out.write(hypothesis + "\n")
                out.flush()
            except OSError as e:
                if out is sys.stdout or not runtime.is_disk_full(e):
                    raise
                raise DiskFullError(
                    f"disk full while writing {output_file} ({runtime.space_report(output_file)}): the translations "
                    f"of the first {len(results)} lines are in {partial}; free space and run again"
                ) from None
            results.append((hypothesis, stats))
        translation = run.stream_result(mode, loaded, results)  # no lines, or a count unlike the references: raises
    except BaseException:
        if partial:
            with contextlib.suppress(OSError):  # closing flushes a line that did not fit again
                out.close()
            if not results:  # nothing translated: no partial output to keep
                with contextlib.suppress(OSError):
                    os.unlink(partial)
        raise
    if partial:
        out.close()
        os.replace(partial, output_file)
    return translation


def _score(mode: ScorePairs, loaded: run.Loaded, output_file: str, progress: bool) -> tuple[dict[str, Any], list[str]]:
    """--score: each pair's log-probability line (scoring.score_lines), and the report with the perplexity."""
    scored = run.score(mode, loaded, progress=progress)
    write_lines(output_file, score_lines(scored.scores))
    stats = scored.report["scoring"]
    summary = (
        f"{len(scored.scores)} pairs scored ({stats['tokens']} target tokens): perplexity {stats['perplexity']:.4f}, "
        f"nll {stats['nll_per_token']:.4f} per token; one line per pair (sum, mean, tokens) in {output_file}"
    )
    return {**scored.report, "scores_file": output_file}, [summary]


def _finish(
    report: dict[str, Any], scores_file: str | None, summary: list[str], as_json: bool, to_stderr: bool = False
) -> dict[str, Any]:
    """Writes the report (when it has a file) and prints the summary, or with --json the report on stdout and the
    summary on stderr; returns the report."""
    if scores_file:
        write_json(scores_file, report)
        summary = [*summary, f"report: {scores_file}"]
    out: TextIO = sys.stderr if (as_json or to_stderr) else sys.stdout
    print("\n".join(summary), file=out)
    if as_json:
        print(to_json(report))
    return report


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs each checkpoint handler it creates at INFO
    evaluate(values_of(flags.FLAGS))


def run_command(prog: str) -> None:
    """The command line `prog` (evaluate.py, or `python -m transformer_jax.evaluation`): defines the flags in absl's
    FLAGS, lists them in --help as the running program's own (absl names the main module by sys.argv[0]), runs main."""
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    define(flags.FLAGS)
    for name in (*command.CHECKPOINT_FLAGS, *command.FLAG):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    cli.run(main, prog)


if __name__ == "__main__":
    run_command("python -m transformer_jax.evaluation")
