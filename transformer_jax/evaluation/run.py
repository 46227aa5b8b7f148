"""Evaluation runs: translate a split or a file with a restored model and score it, or score existing translations.

evaluate.py is the command line over `evaluate` (which checks the options, then runs `score_only` or
`evaluate_model`). The options and their checks are in `evaluation.options`, reading the inputs in
`evaluation.inputs`, restoring the checkpoints in `evaluation.restore`. Everything a user can get wrong (a flag
value, an output that would overwrite an input, an unwritable output location, a file that is not UTF-8 or has no
lines) is found before the model is restored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from transformer_jax import config_checks, files
from transformer_jax.decoding import GNMT, IN_BEAM
from transformer_jax.decoding.ensemble import Ensemble
from transformer_jax.errors import DiskFullError, EvalError
from transformer_jax.evaluation import bleu, mbr, modes, significance
from transformer_jax.evaluation.inputs import read_sources, split_files, split_pairs, stdin_lines
from transformer_jax.evaluation.nbest import nbest_lines
from transformer_jax.evaluation.options import (
    Options,
    check_folder_writable,
    check_options,
    check_writable,
    decoding_settings,
    input_files,
    output_files,
    refuse_overwriting_inputs,
)
from transformer_jax.evaluation.restore import Restorer, restore_model
from transformer_jax.evaluation.scoring import score_lines, score_pairs
from transformer_jax.evaluation.translate import check_nbest, translate, translate_nbest


def evaluate(options: Options, restorer: Restorer | None = None) -> dict[str, Any]:
    """The command line's work: score existing translations, or translate (and score) with a model."""
    options = check_options(options)
    if options.hypotheses_file is not None:
        return score_only(options.hypotheses_file, options.references_file, options.scores_file, options.compare_file)
    return evaluate_model(options, restorer)


def score_only(
    hypotheses_file: str, references_file: str, scores_file: str | None = None, compare_file: str | None = None
) -> dict[str, Any]:
    """Scores of the hypotheses; with `compare_file`, the paired bootstrap comparison with that baseline instead."""
    check_options(
        Options(
            hypotheses_file=hypotheses_file,
            references_file=references_file,
            scores_file=scores_file,
            compare_file=compare_file,
        )
    )
    if scores_file:
        check_writable(scores_file, "--scores_file")
    if compare_file is not None:
        return compare_only(hypotheses_file, compare_file, references_file, scores_file)
    scores = bleu.score_files(hypotheses_file, references_file)
    print(bleu.format_scores(scores))
    if scores_file:
        _write_json(scores_file, {"hypotheses_file": hypotheses_file, "references_file": references_file, **scores})
    return scores


def compare_only(
    hypotheses_file: str, compare_file: str, references_file: str, scores_file: str | None
) -> dict[str, Any]:
    """The paired bootstrap test of --hypotheses_file against the baseline --compare_file (options checked)."""
    result = significance.compare_files(hypotheses_file, compare_file, references_file)
    print(significance.format_comparison(result, system_name=hypotheses_file, baseline_name=compare_file))
    report = {
        "hypotheses_file": hypotheses_file,
        "compare_file": compare_file,
        "references_file": references_file,
        "comparison": result,
    }
    if scores_file:
        _write_json(scores_file, report)
    return report


def evaluate_model(options: Options, restorer: Restorer | None = None) -> dict[str, Any]:
    """Restores, translates, writes the hypotheses and the JSON report; returns the report."""
    with contextlib.ExitStack() as stack:
        return _evaluate_model(check_options(options), restorer, stack)


def _evaluate_model(options: Options, restorer: Restorer | None, stack: contextlib.ExitStack) -> dict[str, Any]:
    if options.config is not None:  # a --config the user gave; the one saved with the checkpoints was checked
        config_checks.validate(options.config)
    # Cheap input and output checks first, so a wrong file fails before the model is built.
    stdin = options.source_file == "-"
    references = None
    if options.references_file:
        references = bleu.read_lines(options.references_file)
    sources = None
    if options.source_file and not stdin:
        sources = read_sources(options.source_file)
        if references is not None:
            bleu.check_line_counts(sources, references, options.source_file, options.references_file)
        if not sources:
            raise EvalError(f"--source_file {options.source_file} has no lines: nothing to translate")
    prefixes = None
    if options.prefix_file is not None:
        prefixes = read_sources(options.prefix_file)
        if sources is not None:
            modes.check_prefix_count(prefixes, sources, options.prefix_file, options.source_file)
    for flag, path in output_files(options.output_file, options.scores_file, stdin).items():
        if path:
            check_writable(path, flag.split(" ")[0])
    if options.output_file is None and not stdin:
        check_folder_writable(Path(options.workdir) / "eval", "--workdir (the default output folder WORKDIR/eval)")

    restorer = restorer or Restorer()
    if options.ensemble_workdirs:
        modes.check_ensemble_members(restorer, options.ensemble_workdirs)
    config, model, steps = restore_model(
        restorer,
        options.workdir,
        config=options.config,
        checkpoint=options.checkpoint,
        average_last=options.average_last,
        average_steps=options.average_steps,
    )
    tokenizer = restorer.tokenizer(config, options.workdir)
    if options.ensemble_workdirs:
        model = Ensemble([model, *modes.restore_members(restorer, options.ensemble_workdirs, config, tokenizer)])
    name = "stdin" if stdin else Path(options.source_file).name if options.source_file else None
    inputs = input_files(options)
    if options.source_file is None:
        split = options.split or "test"
        sources, references, split_name = split_pairs(config, split)
        name = f"{split}({split_name})"
        if prefixes is not None:
            modes.check_prefix_count(prefixes, sources, options.prefix_file, f"--split {split}")
        inputs.update(split_files(config, split_name))
    settings = decoding_settings(options, config)
    search = {
        "length_penalty": options.length_penalty or GNMT,
        "nbest": options.mbr or options.nbest or options.num_samples or 1,
    }
    sampling = modes.sampling_of(options)
    if sampling is None:
        search["finished"] = options.finished or IN_BEAM
    if sampling is not None:
        settings["beam_size"] = 1
        search["sampling"] = {**dataclasses.asdict(sampling), "seed": options.seed or 0, "num_samples": search["nbest"]}
    elif search["nbest"] > 1:
        flag = "--mbr" if options.mbr is not None else "--nbest"
        check_nbest(search["nbest"], settings["beam_size"], flag)  # a beam size from the config
    if options.mbr is not None:
        search["mbr_utility"] = options.mbr_utility or mbr.UTILITIES[0]
    tag = f"step{steps[-1]}" + (f"-avg{len(steps)}" if len(steps) > 1 else "")
    if options.score:
        return _forced_decoding(options, model, tokenizer, config, (sources, references), f"{name}.{tag}", inputs)
    output_file = options.output_file
    if output_file is None and not stdin:
        output_file = str(Path(options.workdir) / "eval" / f"{name}.{tag}.beam{settings['beam_size']}.txt")
    scores_file = options.scores_file or (f"{output_file}.json" if output_file else None)
    nbest_file = f"{output_file}.nbest" if options.nbest is not None or search["nbest"] > 1 else None
    written = {"--output_file": output_file, "--scores_file": scores_file, "--nbest (OUTPUT_FILE.nbest)": nbest_file}
    refuse_overwriting_inputs(written, inputs)
    if stdin:
        hypotheses, stats = translate_stream(
            model,
            tokenizer,
            {**settings, "length_penalty": search["length_penalty"], "finished": search["finished"]},
            output_file,
        )
        if not hypotheses:
            raise EvalError("stdin had no lines: nothing was translated")
        if references is not None:
            bleu.check_line_counts(hypotheses, references, "stdin", options.references_file)
    else:
        lists, stats = translate_nbest(
            model,
            tokenizer,
            sources,
            nbest=search["nbest"],
            length_penalty=search["length_penalty"],
            finished=search.get("finished", IN_BEAM),
            prefixes=prefixes,
            sampling=sampling,
            seed=options.seed or 0,
            progress=True,
            **settings,
        )
        hypotheses = [x[0].text for x in lists]
        if options.mbr is not None:
            u = mbr.utility(search["mbr_utility"])
            hypotheses = [x[mbr.mbr_choice([h.text for h in x], u)].text for x in lists]
        _write_lines(output_file, hypotheses)
        if nbest_file:
            _write_lines(nbest_file, list(nbest_lines(lists)))
            search["nbest_file"] = nbest_file

    blank = {
        "sources": stats["empty"],
        "references": sum(not r.strip() for r in references) if references is not None else None,
    }
    report = {
        "workdir": str(options.workdir),
        "checkpoint_steps": steps,
        "source": name,
        "references_file": options.references_file,
        "hypotheses_file": output_file,
        "decoding": settings,
        "search": search,
        "lines": len(hypotheses),
        "blank_lines": blank,
        "stats": stats,
        "scores": bleu.score_all(hypotheses, references) if references is not None else None,
    }
    out = sys.stderr if (stdin and output_file is None) else sys.stdout
    print(lines_summary(len(hypotheses), blank), file=out)
    if report["scores"] is not None:
        print(bleu.format_scores(report["scores"]), file=out)
    print(json.dumps(report, indent=1, default=str), file=out)
    if scores_file:
        _write_json(scores_file, report)
    return report


def _forced_decoding(options: Options, model, tokenizer, config, pairs, name: str, inputs: dict) -> dict[str, Any]:
    """--score: writes each pair's log-probability line (scoring.score_lines) and the JSON report with the corpus
    perplexity; returns the report."""
    output_file = options.output_file or str(Path(options.workdir) / "eval" / f"{name}.scores.txt")
    scores_file = options.scores_file or f"{output_file}.json"
    refuse_overwriting_inputs({"--output_file": output_file, "--scores_file": scores_file}, inputs)
    batch_size = decoding_settings(options, config)["batch_size"]
    scores, stats = score_pairs(
        model, tokenizer, *pairs, batch_size=batch_size, max_len=config.data.eval_max_len, progress=True
    )
    _write_lines(output_file, score_lines(scores))
    report = {
        "workdir": str(options.workdir),
        "source": name,
        "references_file": options.references_file,
        "scores_file": output_file,
        "lines": len(scores),
        "scoring": stats,
    }
    print(
        f"{len(scores)} pairs scored ({stats['tokens']} target tokens): perplexity {stats['perplexity']:.4f}, "
        f"nll {stats['nll_per_token']:.4f} per token; one line per pair (sum, mean, tokens) in {output_file}"
    )
    _write_json(scores_file, report)
    return report


def lines_summary(lines: int, blank: dict[str, int | None]) -> str:
    """One line: how many lines were translated and how the blank ones were handled and scored."""
    text = f"{lines} lines translated, one hypothesis each; blank source lines: {blank['sources']} (empty hypotheses)"
    if blank["references"] is None:
        return text + "; no references, not scored"
    return (
        text + f"; blank reference lines: {blank['references']}; all {lines} lines scored, as the sacrebleu command "
        "scores them (an empty hypothesis matches nothing; its reference still counts in the reference length)"
    )


def translate_stream(model, tokenizer, settings: dict, output_file: str | None) -> tuple[list[str], dict]:
    """Translates stdin one line at a time, writing each output as soon as it is ready.

    A line that is not UTF-8 stops the run with an EvalError naming it, after the lines before it were written.
    """
    settings = {**settings, "batch_size": 1}  # one line at a time: nothing waits for a full batch
    if output_file:
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
    out = open(output_file, "w", encoding="utf-8") if output_file else sys.stdout
    hypotheses, totals = [], {}
    try:
        for line in stdin_lines():
            [hyp], stats = translate(model, tokenizer, [line], **settings)
            try:
                out.write(hyp + "\n")
                out.flush()
            except OSError as e:
                if out is sys.stdout or not files.is_disk_full(e):
                    raise
                raise _stream_disk_full(output_file, len(hypotheses)) from None
            hypotheses.append(hyp)
            for key in ("sentences", "empty", "truncated", "hit_max_len", "src_tokens", "tgt_tokens", "seconds"):
                totals[key] = totals.get(key, 0) + stats[key]
    except DiskFullError:
        with contextlib.suppress(OSError):  # closing flushes the line that did not fit again
            out.close()
        raise
    finally:
        if out is not sys.stdout and not out.closed:
            out.close()
    return hypotheses, totals


def _stream_disk_full(output_file: str, written: int) -> DiskFullError:
    """The streamed output renamed to OUTPUT.partial (it holds only the lines before the full disk)."""
    partial = f"{output_file}.partial"
    os.replace(output_file, partial)
    return DiskFullError(
        f"disk full while writing {output_file} ({files.space_report(output_file)}): the translations of the first "
        f"{written} lines are in {partial}; free space and run again"
    )


def _write_lines(path: str, lines: list[str]) -> None:
    _write_whole(path, "".join(line + "\n" for line in lines))


def _write_json(path: str, obj: Any) -> None:
    _write_whole(path, json.dumps(obj, indent=1, default=str) + "\n")


def _write_whole(path: str, text: str) -> None:
    """Writes an output whole or not at all; a full disk is one line and leaves any earlier file unchanged."""
    try:
        files.write_text_atomically(path, text)
    except OSError as e:
        if not files.is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full while writing {path} ({files.space_report(path, len(text.encode()))}); nothing was written "
            "there (an earlier file of that name is unchanged): free space or choose another location"
        ) from None
