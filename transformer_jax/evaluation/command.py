"""evaluate.py's command line, also `python -m transformer_jax.evaluation` (both call `run_command`): its flags (one
table, `FLAGS`, and the checkpoint flags shared with every command that restores a model), the checks that turn them
into a mode record of evaluation.run, and the outputs: the files written, the summary lines printed; the JSON report
goes to --scores_file (default beside the output), and to stdout with --json.

`parse(values)` turns the flag values into a mode record (`ScoresOnly`, `Compare`, `Translate`, `ScorePairs`) and the
command line's `Outputs`, or raises EvalError naming the flag and what to do, before any file is read; the library
(evaluation/run.py) runs the record; `evaluate(values)` writes what it returns. Every output location is checked
before the model is restored, and no output may be an input (under any spelling or link): the default names are
checked once the restored checkpoints name them, before anything is translated.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli, decoding, runtime
from transformer_jax.errors import DiskFullError, EvalError
from transformer_jax.evaluation import matrix, run, significance
from transformer_jax.evaluation.restore import CheckpointChoice, check_choice
from transformer_jax.evaluation.run import (
    UTILITIES,
    Compare,
    Decoding,
    Matrix,
    Mode,
    Model,
    ScorePairs,
    ScoresOnly,
    Translate,
    check_numbers,
    input_files,
    sampling_of,
)
from transformer_jax.evaluation.scoring import score_lines
from transformer_jax.evaluation.translate import check_nbest, check_sampling, format_scores, nbest_lines

# -- the checkpoint flags: evaluate.py's, the export's, translate_corpus's (same names, defaults, help), so that
# an export serves exactly the parameters evaluate.py scored -----------------------------------------------------

CHECKPOINT_FLAGS = ("workdir", "config", "checkpoint", "average_last", "average_steps", "average_best")


def define_checkpoint_flags(flag_values: flags.FlagValues = flags.FLAGS) -> None:
    """Defines --config, --workdir, --checkpoint, --average_last, --average_steps and --average_best."""
    fv = {"flag_values": flag_values}
    config_flags.DEFINE_config_file(
        "config", None, "Config file; default: the config saved with the checkpoints.", **fv
    )
    flags.DEFINE_string("workdir", None, "Training directory with checkpoints/ and the tokenizer.", **fv)
    flags.DEFINE_string(
        "checkpoint",
        "latest",
        "latest, best (the best by train.select_metric, kept by ckpt.keep_best), or the step of the last checkpoint "
        "to use.",
        **fv,
    )
    flags.DEFINE_integer(
        "average_last", None, "Average this many checkpoints ending at --checkpoint (config.eval).", **fv
    )
    flags.DEFINE_list(
        "average_steps", None, "Average exactly these checkpoint steps (instead of --average_last).", **fv
    )
    flags.DEFINE_integer(
        "average_best", None, "Average the K best checkpoints by train.select_metric (instead of --average_last).", **fv
    )


def choice_of(values: Mapping[str, Any]) -> CheckpointChoice:
    """The CheckpointChoice of the checkpoint flags' values (by name; absent: unset), as given."""
    given = {f.name: values[f.name] for f in dataclasses.fields(CheckpointChoice) if values.get(f.name) is not None}
    return CheckpointChoice(**given)


# The modes a flag can be read by: scores only and compare (no model), and the model's modes (translate, --score).
NO_MODEL, MODEL = "no_model", "model"


@dataclasses.dataclass(frozen=True)
class Flag:
    """One of evaluate.py's flags: everything known of it, in one place."""

    name: str
    type: type  # str, int, float, bool or list (of str)
    help: str
    modes: tuple[str, ...]  # which modes read it: NO_MODEL, MODEL
    choices: tuple[str, ...] = ()  # the allowed values (empty: any)
    default: Any = None  # what an unset flag means, when that is a constant (else the help names the config key)
    needs: str = ""  # the flag it tunes, without which it is refused (--temperature needs --sampling)

    def describe(self) -> str:
        text = self.help
        if self.choices:
            text += f" One of {', '.join(self.choices)}."
        if self.default is not None:
            text += f" Default {self.default}."
        if self.needs:
            text += f" Needs --{self.needs}."
        return text


BOTH = (NO_MODEL, MODEL)
FLAGS = (
    Flag(
        "split",
        str,
        "Split to translate: valid or test (data.valid_split, data.test_split), or the name of {split}.{lang} files "
        "of the text folder.",
        (MODEL,),
        default="test",
    ),
    Flag("text_dir", str, "Read --split's {split}.{lang} files from this folder instead of data.text_dir.", (MODEL,)),
    Flag("source_file", str, "Translate this file (one sentence a line; '-' = stdin) instead of --split.", (MODEL,)),
    Flag("references_file", str, "References, one a line, for --source_file or --hypotheses_file.", BOTH),
    Flag("hypotheses_file", str, "Score this file against --references_file; no model is loaded.", (NO_MODEL,)),
    Flag("compare_file", str, "With --hypotheses_file: the baseline's translations; paired bootstrap.", (NO_MODEL,)),
    Flag("beam_size", int, "Beams (default config.eval.beam_size); 1 is greedy search.", (MODEL,)),
    Flag("alpha", float, "Length penalty exponent (default config.eval.alpha).", (MODEL,)),
    Flag("max_extra_len", int, "Output tokens beyond the input length (default config.eval).", (MODEL,)),
    Flag("max_len", int, "At most this many output tokens, EOS included (default config.eval; 0: no cap).", (MODEL,)),
    Flag("batch_size", int, "Sentences per decoding batch (default config.eval.batch_size).", (MODEL,)),
    Flag(
        "output_file",
        str,
        "Hypotheses file; default WORKDIR/eval/<source>.<steps>[-best].<search>.txt (stdin: stdout).",
        (MODEL,),
    ),
    Flag(
        "scores_file",
        str,
        "The JSON report; default OUTPUT_FILE.json (stdin to stdout: WORKDIR/eval/stdin.<steps>.json; scores only: "
        "none).",
        BOTH,
    ),
    Flag("json", bool, "Print the JSON report on stdout (the summary lines go to stderr).", BOTH),
    Flag(
        "length_penalty",
        str,
        "Score normalisation (average: score / len^alpha).",
        (MODEL,),
        decoding.LENGTH_PENALTIES,
        Decoding.length_penalty,
    ),
    Flag(
        "finished",
        str,
        "Beam search's rule for ended hypotheses (set_aside: CTranslate2's).",
        (MODEL,),
        decoding.FINISHED_RULES,
        Decoding.finished,
    ),
    Flag("nbest", int, "Also write each line's N (<= beam) best to OUTPUT_FILE.nbest (Marian format).", (MODEL,)),
    Flag("prefix_file", str, "Line i's translation starts with line i of this file (empty line: none).", (MODEL,)),
    Flag("sampling", bool, "Draw translations from the model instead of searching (beam size 1).", (MODEL,)),
    Flag("temperature", float, "Divide the logits by this (> 0; default 1).", (MODEL,), needs="sampling"),
    Flag("top_k", int, "Draw among the k most probable tokens (default 0: all).", (MODEL,), needs="sampling"),
    Flag(
        "top_p", float, "Draw from the smallest set holding this probability (default 1).", (MODEL,), needs="sampling"
    ),
    Flag(
        "num_samples",
        int,
        "Samples per line; more than one go to OUTPUT_FILE.nbest.",
        (MODEL,),
        default=1,
        needs="sampling",
    ),
    Flag(
        "seed",
        int,
        "The seed; a line's samples depend on it and the line only.",
        (MODEL,),
        default=Decoding.seed,
        needs="sampling",
    ),
    Flag("mbr", int, "Choose among N candidates (the N-best, or N samples) by expected utility (MBR).", (MODEL,)),
    Flag("mbr_utility", str, "The utility of MBR's choice.", (MODEL,), UTILITIES, UTILITIES[0], needs="mbr"),
    Flag(
        "target_lang",
        str,
        "Translate into this language: a multilingual model's (its name or >>code<<; default the only one it "
        "translates into), or a Marian model's >>LANG<< source token (default data.target_lang).",
        (MODEL,),
    ),
    Flag(
        "source_lang",
        str,
        "A multilingual model's source language: names --split's source file; with --source_file only for models "
        "whose sources carry their own language's token (model.lang_token=source_and_target).",
        (MODEL,),
    ),
    Flag("ensemble_workdirs", list, "More workdirs whose models decode with --workdir's (one tokenizer).", (MODEL,)),
    Flag("score", bool, "Forced decoding: log P(reference | source) per line and the perplexity.", (MODEL,)),
    Flag(
        "directions",
        list,
        "A multilingual model's language matrix of --split's files: all, or SRC-TGT directions (comma-separated).",
        (MODEL,),
    ),
    Flag("pivot", str, "Also translate the zero-shot directions through this language.", (MODEL,), needs="directions"),
    Flag(
        "output_dir",
        str,
        "The matrix's folder; default WORKDIR/eval/matrix.<split>.<steps>.",
        (MODEL,),
        needs="directions",
    ),
)
FLAG = {flag.name: flag for flag in FLAGS}


def define(flag_values, names: Sequence[str] | None = None) -> None:
    """Defines evaluate.py's flags (the checkpoint flags too, shared with the export) in absl's `flag_values`;
    `names`: only these of the table (a command that reads a subset, as translate_corpus).

    Every default is None (False for a switch): a flag's value there means "given", and its meaning when unset is
    applied by `parse`."""
    define_checkpoint_flags(flag_values)
    kind = {str: "string", int: "integer", float: "float", bool: "bool", list: "list"}
    for flag in FLAGS if names is None else [FLAG[name] for name in names]:
        unset = False if flag.type is bool else None
        # Choices are checked by `parse` (exit status 1), so that library callers get the same check.
        getattr(flags, f"DEFINE_{kind[flag.type]}")(flag.name, unset, flag.describe(), flag_values=flag_values)


def values_of(flag_values) -> dict[str, Any]:
    return {name: flag_values[name].value for name in (*CHECKPOINT_FLAGS, *FLAG)}


# -- the command line's outputs, and the checks -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Outputs:
    """What the command line writes: the hypotheses (or --score's lines) and the JSON report, and where it prints."""

    output_file: str | None = None  # None: the default (`evaluate`), or stdout for stdin
    scores_file: str | None = None  # None: OUTPUT_FILE.json
    json: bool = False  # the report on stdout
    output_dir: str | None = None  # --directions' folder; None: WORKDIR/eval/matrix.<split>.<steps>


def parse(values: Mapping[str, Any]) -> tuple[Mode, Outputs]:
    """The mode record and the outputs the flag values ask for (names as the flags; absent or None: unset), or
    EvalError naming the flag and what to do. Reads no file.

    Every check is made here, once: each flag by what the table says of it, then the combinations as given
    (`_check_request`), then the checkpoints (restore.check_choice); the constant defaults are filled in last."""
    unknown = set(values) - {*CHECKPOINT_FLAGS, *FLAG}
    if unknown:
        raise TypeError(f"not evaluate.py flags: {sorted(unknown)}")
    unset = {name: False if flag.type is bool else None for name, flag in FLAG.items()}
    v = {**dict.fromkeys(CHECKPOINT_FLAGS), **unset, **values}
    v["checkpoint"] = "latest" if v["checkpoint"] is None else v["checkpoint"]
    if v["compare_file"] is not None and (v["hypotheses_file"] is None or not v["references_file"]):
        raise EvalError(
            "--compare_file needs --hypotheses_file and --references_file: it compares two systems' translations "
            "of the same references"
        )
    outputs = Outputs(v["output_file"], v["scores_file"], bool(v["json"]), v["output_dir"])
    if v["hypotheses_file"] is not None:
        return _no_model(v), outputs
    if not v["workdir"]:
        raise EvalError("give --workdir (translate with a trained model) or --hypotheses_file (score only)")
    for flag in FLAGS:
        value = v[flag.name]
        if flag.choices and value is not None and value not in flag.choices:
            raise EvalError(f"--{flag.name} {value!r}: choose one of {', '.join(flag.choices)}")
    if v["source_file"] is not None:
        if not v["source_file"]:
            raise EvalError("--source_file is empty: give a file, or - for stdin")
        if v["split"] is not None:
            raise EvalError("give --split or --source_file, not both")
    elif v["references_file"] is not None:
        raise EvalError("--references_file goes with --source_file; a --split brings its own references")
    if v["text_dir"] is not None and v["source_file"] is not None:
        raise EvalError("--text_dir holds --split's files; --source_file names its own: drop one of them")
    if v["split"] is not None and not v["split"].strip():
        raise EvalError("--split is empty: give valid, test, or the name of a split of the text folder")
    check_numbers({name: v[name] for name in ("beam_size", "batch_size", "max_extra_len", "alpha", "max_len")}, "--")
    for switch in dict.fromkeys(flag.needs for flag in FLAGS if flag.needs):
        tuning = [f"--{f.name}" for f in FLAGS if f.needs == switch and v[f.name] is not None]
        if tuning and not v[switch]:
            one = len(tuning) == 1
            raise EvalError(
                f"{', '.join(tuning)} {'goes' if one else 'go'} with --{switch}: add --{switch}, or drop "
                f"{'it' if one else 'them'}"
            )
    if v["directions"] is not None:
        return _matrix(v), outputs
    members = None if v["ensemble_workdirs"] is None else tuple(v["ensemble_workdirs"])
    model = Model(v["workdir"], v["config"], choice_of(v), members, v["target_lang"], v["source_lang"])
    split = v["split"] or (FLAG["split"].default if v["source_file"] is None else None)
    given = Decoding(**{f.name: v[f.name] for f in dataclasses.fields(Decoding)})  # as given: None is unset
    request = Translate(
        model, split, v["source_file"], v["references_file"], v["prefix_file"], given, text_dir=v["text_dir"]
    )
    _check_request(request, bool(v["score"]))
    if outputs.json and request.stdin and outputs.output_file is None:
        raise EvalError("--json prints the report on stdout, where stdin's translations go: give --output_file")
    model = dataclasses.replace(model, choice=check_choice(model.choice))
    written = output_files(outputs.output_file, outputs.scores_file, request.stdin)
    if given.nbest is not None and outputs.output_file is not None:
        written["--nbest (OUTPUT_FILE.nbest)"] = f"{outputs.output_file}.nbest"
    if v["score"]:
        mode = ScorePairs(
            model, split, request.source_file, request.references_file, given.batch_size, text_dir=v["text_dir"]
        )
    else:
        mode = dataclasses.replace(request, model=model, decoding=_with_defaults(given))
        if mode.decoding.sampling:
            check_sampling(sampling_of(mode.decoding), mode.decoding.mbr or mode.decoding.num_samples)
    runtime.refuse_overwriting_inputs(written, input_files(mode))
    return mode, outputs


def _no_model(v: Mapping[str, Any]) -> ScoresOnly | Compare:
    """The scores modes' record; every flag a model would read is refused (the table says which)."""
    hypotheses, baseline, references = v["hypotheses_file"], v["compare_file"], v["references_file"]
    if not references:
        raise EvalError("--hypotheses_file needs --references_file")
    if baseline is not None:
        if not baseline:
            raise EvalError("--compare_file is empty: give the baseline system's translations")
        if runtime.same_file(baseline, hypotheses):
            raise EvalError(
                f"--compare_file {baseline} is --hypotheses_file {hypotheses}: a system compared "
                "with itself differs by nothing; give the other system's translations"
            )
    given = [f"--{name}" for name in CHECKPOINT_FLAGS if name != "checkpoint" and v[name] is not None]
    given += ["--checkpoint"] if v["checkpoint"] != "latest" else []
    given += [f"--{f.name}" for f in FLAGS if NO_MODEL not in f.modes and v[f.name] not in (None, False)]
    if given:
        raise EvalError(
            f"--hypotheses_file scores existing translations without a model; {', '.join(given)} "
            "would be ignored: drop them, or drop --hypotheses_file to translate"
        )
    inputs = {"--hypotheses_file": hypotheses, "--compare_file": baseline, "--references_file": references}
    runtime.refuse_overwriting_inputs({"--scores_file": v["scores_file"]}, inputs)
    return ScoresOnly(hypotheses, references) if baseline is None else Compare(hypotheses, baseline, references)


# What a matrix cannot honour: it reads every language's --split file, writes its own folder, and beam-searches.
MATRIX_REFUSES = (
    *("source_file", "references_file", "prefix_file", "output_file", "scores_file", "target_lang", "source_lang"),
    *("nbest", "sampling", "mbr", "score", "ensemble_workdirs"),
)


def _matrix(v: Mapping[str, Any]) -> Matrix:
    """--directions' record (evaluation/matrix.py), the flags it cannot honour refused."""
    given = [f"--{name}" for name in MATRIX_REFUSES if v.get(name) not in (None, False)]
    if given:
        raise EvalError(
            f"--directions translates --split's files of every language into --output_dir; {', '.join(given)} "
            "cannot go with it: drop them"
        )
    entries = tuple(v["directions"])
    if not entries or not all(entries) or ("all" in entries and len(entries) > 1):
        raise EvalError(f"--directions {','.join(entries)!r}: give all, or SRC-TGT directions joined by commas")
    if v["pivot"] is not None and not v["pivot"]:
        raise EvalError("--pivot is empty: give one of the model's languages")
    model = Model(v["workdir"], v["config"], check_choice(choice_of(v)))
    search = ("beam_size", "alpha", "max_extra_len", "max_len", "batch_size", "length_penalty", "finished")
    decoding = _with_defaults(Decoding(**{name: v[name] for name in search}))
    return Matrix(model, entries, v["split"] or FLAG["split"].default, v["text_dir"], v["pivot"], decoding)


def _with_defaults(given: Decoding) -> Decoding:
    """The Decoding of checked flags as given, the table's constant defaults filled in."""
    num_samples = given.num_samples
    if given.sampling and num_samples is None and given.mbr is None:
        num_samples = FLAG["num_samples"].default
    return dataclasses.replace(
        given,
        sampling=bool(given.sampling),
        length_penalty=given.length_penalty or FLAG["length_penalty"].default,
        finished=given.finished or FLAG["finished"].default,
        seed=FLAG["seed"].default if given.seed is None else given.seed,
        mbr_utility=(given.mbr_utility or FLAG["mbr_utility"].default) if given.mbr is not None else None,
        num_samples=num_samples,
    )


def output_files(output_file: str | None, scores_file: str | None, stdin: bool) -> dict[str, str | None]:
    if scores_file is None and output_file is not None:
        return {"--output_file": output_file, "--scores_file (default OUTPUT_FILE.json)": f"{output_file}.json"}
    if output_file is None and not stdin:
        return {"--scores_file": scores_file}  # the default output is checked once its name is known
    return {"--output_file": output_file, "--scores_file": scores_file}


# The flags of a search, which --score (forced decoding: no search) would ignore.
SEARCH_FLAGS = ("beam_size", "alpha", "max_extra_len", "max_len", "length_penalty", "finished", "nbest")


def _check_request(request: Translate, score: bool) -> None:
    """EvalError for flags that cannot work together, read from the request's records as given (None: unset; `score`:
    --score's forced decoding instead)."""
    d, stdin = request.decoding, request.stdin
    if d.mbr is not None:
        if d.mbr < 2:
            raise EvalError(f"--mbr {d.mbr}: choose among at least 2 candidates")
        for name in ("nbest", "num_samples"):
            if getattr(d, name) is not None:
                raise EvalError(f"--mbr N sets how many candidates there are; --{name} would be ignored: drop it")
        if score or stdin:
            raise EvalError("--mbr translates a --source_file or a --split (not --score, not stdin)")
    if d.sampling:
        if d.beam_size not in (None, 1):
            raise EvalError(f"--sampling draws one token per step; --beam_size {d.beam_size} would be ignored")
        if d.nbest is not None or score:
            raise EvalError("--sampling draws --num_samples translations per line; drop --nbest and --score")
        if d.finished is not None:
            raise EvalError("--finished is beam search's rule; --sampling does not search: drop one of them")
        if stdin:
            raise EvalError("--sampling needs a --source_file or a --split: stdin is translated one line at a time")
    if request.prefix_file is not None and (score or stdin):
        raise EvalError("--prefix_file goes with translating a --source_file or a --split (not --score, not stdin)")
    members = request.model.ensemble_workdirs
    if members is not None and (not members or not all(members)):
        raise EvalError(f"--ensemble_workdirs must be workdirs separated by commas, got {list(members)}")
    if score:
        searching = [f"--{k}" for k in SEARCH_FLAGS if getattr(d, k) is not None]
        if searching:
            raise EvalError(
                f"--score teacher-forces the given targets; {', '.join(searching)} would be ignored: drop "
                f"{'it' if len(searching) == 1 else 'them'}"
            )
        if stdin:
            raise EvalError("--score reads its pairs from --source_file and --references_file, not stdin")
        if request.source_file is not None and not request.references_file:
            raise EvalError("--score needs --references_file (the targets to score) with --source_file, or a --split")
    if d.nbest is not None:
        if stdin:
            raise EvalError("--nbest needs a --source_file or a --split: stdin is translated one line at a time")
        # Without --beam_size only nbest >= 1 can be checked here; run.settings_of checks the config's beam size.
        check_nbest(d.nbest, d.nbest if d.beam_size is None else d.beam_size)


# -- the command: evaluate.py, also `python -m transformer_jax.evaluation` ----------------------------------------

DEFAULT_FOLDER = "eval"  # WORKDIR/eval holds the outputs that have no name given


def evaluate(values: Mapping[str, Any], *, progress: bool = True) -> dict[str, Any]:
    """What evaluate.py does with these flag values (by name; absent: unset): writes the outputs, prints the
    summary, returns the report."""
    mode, outputs = parse(values)
    if isinstance(mode, ScoresOnly | Compare):
        return _write_scores(mode, outputs)
    if isinstance(mode, Matrix):
        return _write_matrix(mode, outputs, progress)
    stdin = getattr(mode, "stdin", False)
    for flag, path in output_files(outputs.output_file, outputs.scores_file, stdin).items():
        if path:
            runtime.check_writable(path, flag.split(" ")[0])
    folder = Path(mode.model.workdir) / DEFAULT_FOLDER
    if outputs.output_file is None and (not stdin or outputs.scores_file is None):
        kind = "output" if not stdin else "report"
        runtime.check_folder_writable(folder, f"--workdir (the default {kind} folder WORKDIR/{DEFAULT_FOLDER})")
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
    runtime.refuse_overwriting_inputs(written, loaded.inputs)
    if isinstance(mode, ScorePairs):
        report, summary = _score(mode, loaded, output_file, progress)
        return _finish(report, scores_file, summary, outputs.json)
    if stdin:
        translation = _stream(mode, loaded, output_file)
    else:
        translation = run.translate(mode, loaded, progress=progress)
        runtime.write_lines(output_file, translation.hypotheses)
    report = {**translation.report, "hypotheses_file": output_file}
    summary = [run.lines_summary(report["lines"], report["blank_lines"])]
    if report["scores"] is not None:
        summary.append(format_scores(report["scores"]))
    if nbest_file:
        runtime.write_lines(nbest_file, list(nbest_lines(translation.lists)))
        report["search"] = {**report["search"], "nbest_file": nbest_file}
    if not stdin:
        summary.append(f"hypotheses: {output_file}" + (f"; n-best lists: {nbest_file}" if nbest_file else ""))
    # With stdin's translations on stdout, the summary goes to stderr.
    return _finish(report, scores_file, summary, outputs.json, to_stderr=output_file is None)


def _write_scores(mode: ScoresOnly | Compare, outputs: Outputs) -> dict[str, Any]:
    if outputs.scores_file:
        runtime.check_writable(outputs.scores_file, "--scores_file")
    if isinstance(mode, Compare):
        report = run.compare(mode)
        summary = significance.format_comparison(
            report["comparison"], system_name=mode.hypotheses_file, baseline_name=mode.compare_file
        )
    else:
        report = run.scores_only(mode)
        summary = format_scores(report)
    return _finish(report, outputs.scores_file, [summary], outputs.json)


def _write_matrix(mode: Matrix, outputs: Outputs, progress: bool) -> dict[str, Any]:
    """--directions: the folder, languages, directions and the output folder checked before anything is translated;
    then each direction's outputs, report.json, meta.json and heatmap.png (evaluation/matrix.py) in the folder."""
    plan = matrix.check(mode)
    flag = "--output_dir"
    if outputs.output_dir is not None:
        check_output_dir(Path(outputs.output_dir), flag)
    loaded = matrix.restore(mode)
    folder = Path(outputs.output_dir or Path(mode.model.workdir) / DEFAULT_FOLDER / f"matrix.{plan.split}.{loaded.tag}")
    if outputs.output_dir is None:
        check_output_dir(folder, f"--workdir (the default folder WORKDIR/{DEFAULT_FOLDER}/matrix.<split>.<steps>)")
    result = matrix.translate(mode, plan, loaded, progress=progress)
    summary = matrix.write(result, plan, folder)
    return _finish(result.report, str(folder / matrix.REPORT), summary, outputs.json)


def check_output_dir(folder: Path, flag: str) -> None:
    """EvalError unless `folder` can hold a matrix (matrix.check_folder) and be written in."""
    matrix.check_folder(folder, flag)
    runtime.check_folder_writable(folder, flag)


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
    runtime.write_lines(output_file, score_lines(scored.scores))
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
        runtime.write_json(scores_file, report)
        summary = [*summary, f"report: {scores_file}"]
    out: TextIO = sys.stderr if (as_json or to_stderr) else sys.stdout
    print("\n".join(summary), file=out)
    if as_json:
        print(runtime.to_json(report))
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
    for name in (*CHECKPOINT_FLAGS, *FLAG):
        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS[name])
    cli.run(main, prog)
