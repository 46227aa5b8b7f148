"""Evaluation runs: translate a split or a file with a restored model and score it, or score existing translations.

evaluate.py is the command line over `evaluate` (which checks the options, then runs `score_only` or
`evaluate_model`); the checkpoint restoring is in `transformer_jax.evaluation.restore`. Everything a user can get
wrong (a flag value, an output that would overwrite an input, an unwritable output location, a file that is not
UTF-8 or has no lines) is found before the model is restored.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_jax.decoding import GNMT
from transformer_jax.decoding.ensemble import Ensemble
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import mbr, modes
from transformer_jax.evaluation.nbest import nbest_lines
from transformer_jax.evaluation.restore import Restorer, restore_model
from transformer_jax.evaluation.scoring import score_lines, score_pairs
from transformer_jax.evaluation.translate import check_nbest, translate_nbest

SPLITS = ("valid", "test")


@dataclasses.dataclass
class Options:
    """What to translate with which checkpoints and settings; None means the config's value (config.eval).

    Field names are the command-line flags (--beam_size ...), which error messages name.
    """

    workdir: str | None = None
    config: Any = None  # ml_collections.ConfigDict, or None: the one saved with the checkpoints
    checkpoint: str = "latest"
    average_last: int | None = None
    average_steps: Sequence[int | str] | None = None
    split: str | None = None  # None: test (when there is no source_file)
    source_file: str | None = None
    references_file: str | None = None
    hypotheses_file: str | None = None  # scores-only mode: no model
    compare_file: str | None = None  # scores-only mode: the baseline of a paired bootstrap test against hypotheses
    beam_size: int | None = None
    alpha: float | None = None
    max_extra_len: int | None = None
    batch_size: int | None = None
    output_file: str | None = None
    scores_file: str | None = None
    length_penalty: str | None = None  # gnmt | average | none (None: decoding.GNMT)
    nbest: int | None = None  # also write each line's N best hypotheses to OUTPUT_FILE.nbest (evaluation/nbest.py)
    prefix_file: str | None = None  # line i's translation starts with line i of this file (target side)
    sampling: bool = False  # draw translations instead of searching (decoding/sampling.py); the five below tune it
    temperature: float | None = None  # None: decoding.sampling.PLAIN's
    top_k: int | None = None
    top_p: float | None = None
    num_samples: int | None = None  # samples per line (None: 1); more than one also go to OUTPUT_FILE.nbest
    seed: int | None = None  # None: 0
    mbr: int | None = None  # choose among this many candidates (the n-best, or samples) by expected utility (mbr.py)
    mbr_utility: str | None = None  # bleu | chrf (None: bleu)
    ensemble_workdirs: Sequence[str] | None = None  # more models decoding with --workdir's (decoding/ensemble.py)
    score: bool = False  # forced decoding: log P(reference | source) per line instead of translating (scoring.py)


# -- checking the options, in one place ---------------------------------------------------------------------------

_MODEL_FLAGS = (
    "workdir",
    "config",
    "average_last",
    "average_steps",
    "split",
    "source_file",
    "beam_size",
    "alpha",
    "max_extra_len",
    "batch_size",
    "output_file",
    "length_penalty",
    "nbest",
    "prefix_file",
    "temperature",
    "top_k",
    "top_p",
    "num_samples",
    "seed",
    "mbr",
    "mbr_utility",
    "ensemble_workdirs",
)
_AT_LEAST_ONE = ("beam_size", "batch_size", "max_extra_len", "average_last")


def check_options(options: Options) -> Options:
    """The options with --average_steps as ints, or EvalError naming the flag and what to do. Reads no file."""
    o = options
    if o.compare_file is not None and (o.hypotheses_file is None or not o.references_file):
        raise EvalError(
            "--compare_file needs --hypotheses_file and --references_file: it compares two systems' translations "
            "of the same references"
        )
    if o.hypotheses_file is not None:
        if not o.references_file:
            raise EvalError("--hypotheses_file needs --references_file")
        if o.compare_file is not None:
            if not o.compare_file:
                raise EvalError("--compare_file is empty: give the baseline system's translations")
            if _same_file(o.compare_file, o.hypotheses_file):
                raise EvalError(
                    f"--compare_file {o.compare_file} is --hypotheses_file {o.hypotheses_file}: a system compared "
                    "with itself differs by nothing; give the other system's translations"
                )
        given = [f"--{name}" for name in _MODEL_FLAGS if getattr(o, name) is not None]
        given += ["--checkpoint"] if o.checkpoint != "latest" else []
        given += ["--score"] if o.score else []
        if given:
            raise EvalError(
                f"--hypotheses_file scores existing translations without a model; {', '.join(given)} "
                "would be ignored: drop them, or drop --hypotheses_file to translate"
            )
        _refuse_overwriting_inputs(
            {"--scores_file": o.scores_file},
            {
                "--hypotheses_file": o.hypotheses_file,
                "--compare_file": o.compare_file,
                "--references_file": o.references_file,
            },
        )
        return o
    if not o.workdir:
        raise EvalError("give --workdir (translate with a trained model) or --hypotheses_file (score only)")
    if o.split is not None and o.split not in SPLITS:
        raise EvalError(f"--split {o.split!r}: choose one of {', '.join(SPLITS)}")
    if o.source_file is not None:
        if not o.source_file:
            raise EvalError("--source_file is empty: give a file, or - for stdin")
        if o.split is not None:
            raise EvalError("give --split or --source_file, not both")
    elif o.references_file is not None:
        raise EvalError("--references_file goes with --source_file; a --split brings its own references")
    check_numbers({name: getattr(o, name) for name in (*_AT_LEAST_ONE, "alpha")}, "--")
    modes.check_flags(o)
    if str(o.checkpoint) != "latest" and not _is_step(o.checkpoint):
        raise EvalError(f"--checkpoint must be 'latest' or a step number, got {o.checkpoint!r}")
    average_steps = None
    if o.average_steps is not None:
        if o.average_last is not None:
            raise EvalError("give --average_last or --average_steps, not both")
        if str(o.checkpoint) != "latest":
            raise EvalError("--average_steps names its steps; --checkpoint would be ignored: drop one of them")
        if not o.average_steps or not all(_is_step(s) for s in o.average_steps):
            raise EvalError(f"--average_steps must be step numbers separated by commas, got {list(o.average_steps)}")
        average_steps = [int(s) for s in o.average_steps]
        duplicates = sorted({s for s in average_steps if average_steps.count(s) > 1})
        if duplicates:
            raise EvalError(f"--average_steps lists step(s) {duplicates} more than once")
    outputs = _outputs(o.output_file, o.scores_file, o.source_file == "-")
    if o.nbest is not None and o.output_file is not None:
        outputs["--nbest (OUTPUT_FILE.nbest)"] = f"{o.output_file}.nbest"
    _refuse_overwriting_inputs(outputs, _inputs(o))
    return dataclasses.replace(o, average_steps=average_steps, checkpoint=str(o.checkpoint))


def check_numbers(values: dict[str, Any], prefix: str) -> None:
    """EvalError for a decoding value that cannot work, by the rule of its config key (config_checks.RULES, the
    one source of allowed ranges); `prefix` + key is the name a user set it by (--beam_size, config.eval.alpha)."""
    from transformer_jax import config_checks
    from transformer_jax.errors import ConfigError

    for key, value in values.items():
        if value is None:
            continue
        try:
            config_checks.RULES[f"eval.{key}"].check(f"eval.{key}", value, name=f"{prefix}{key}")
        except ConfigError as e:
            raise EvalError(str(e)) from e


def _is_step(value: Any) -> bool:
    text = str(value).strip()
    return text.isascii() and text.isdigit()


def _inputs(o: Options) -> dict[str, str | None]:
    return {
        "--source_file": None if o.source_file == "-" else o.source_file,
        "--references_file": o.references_file,
        "--prefix_file": o.prefix_file,
    }


def _outputs(output_file: str | None, scores_file: str | None, stdin: bool) -> dict[str, str | None]:
    if scores_file is None and output_file is not None:
        return {"--output_file": output_file, "--scores_file (default OUTPUT_FILE.json)": f"{output_file}.json"}
    if output_file is None and not stdin:
        return {"--scores_file": scores_file}  # the default output is checked once its name is known
    return {"--output_file": output_file, "--scores_file": scores_file}


def _same_file(a: str, b: str) -> bool:
    """Whether a and b name one file: any spelling, symbolic or hard links (paths that do not exist: spelling)."""
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _refuse_overwriting_inputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
    outputs = {k: v for k, v in outputs.items() if v}
    inputs = {k: v for k, v in inputs.items() if v}
    for out_flag, out in outputs.items():
        for in_flag, path in inputs.items():
            if _same_file(out, path):
                raise EvalError(
                    f"{out_flag} {out} is the input {in_flag} {path}: writing it would destroy the input; "
                    "choose another output file"
                )
    names = list(outputs.items())
    for i, (flag_a, a) in enumerate(names):
        for flag_b, b in names[i + 1 :]:
            if _same_file(a, b):
                raise EvalError(f"{flag_a} and {flag_b} are the same file {a}; choose two different files")


def check_writable(path: str | os.PathLike, flag: str) -> None:
    """EvalError unless file `path` can be written, its folder created: tested without leaving anything behind."""
    path = Path(path)
    if path.is_dir():
        raise EvalError(f"{flag} {path} is a directory; give a file name")
    if path.exists() and not os.access(path, os.W_OK):
        raise EvalError(f"{flag} {path}: permission denied; choose another output file")
    check_folder_writable(path.parent, flag)


def check_folder_writable(folder: str | os.PathLike, flag: str) -> None:
    """EvalError unless files can be written in `folder`, which may not exist yet (then: can it be created)."""
    folder = wanted = Path(folder)
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent  # the nearest existing ancestor: the missing folders are made in it when writing
    if not folder.is_dir():
        raise EvalError(f"{flag}: {folder} is not a directory, so {wanted} cannot be created; choose another location")
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        raise EvalError(f"{flag}: cannot write in {folder} ({e.strerror or e}); choose another location") from e


# -- reading inputs -----------------------------------------------------------------------------------------------


def read_sources(path: str) -> list[str]:
    """Lines of a UTF-8 file split at LF only, each with its line ending removed (nothing else)."""
    from transformer_jax.evaluation import bleu

    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e.strerror or e}") from e
    return [line.rstrip("\r") for line in bleu.decode_lines(data, path, EvalError)]


def split_pairs(config, split: str) -> tuple[list[str], list[str], str]:
    """Every line of the split, blank ones included: evaluation gives one hypothesis per source line."""
    from transformer_jax.data import sources

    name = config.data.valid_split if split == "valid" else config.data.test_split
    pairs = sources.read_all(sources.open_split(config.data, name, keep_blank=True))
    if not pairs:
        raise EvalError(f"split {name!r} of data.source={config.data.source} has no lines: nothing to translate")
    return [s for s, _ in pairs], [t for _, t in pairs], name


def split_files(config, split_name: str) -> dict[str, str]:
    """The files a text split is read from (for the output-is-not-an-input check); none for other sources."""
    if config.data.source != "text":
        return {}
    from transformer_jax.data import sources

    directory = sources.resolve_path(config.data.text_dir)
    return {
        f"split file ({lang})": str(directory / f"{split_name}.{lang}")
        for lang in (config.data.src_lang, config.data.tgt_lang)
    }


# -- the two modes ------------------------------------------------------------------------------------------------


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
    from transformer_jax.evaluation import bleu

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
    from transformer_jax.evaluation import significance

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
    from transformer_jax.evaluation import bleu

    options = check_options(options)
    if options.config is not None:  # a --config the user gave; the one saved with the checkpoints was checked
        from transformer_jax import config_checks

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
    for flag, path in _outputs(options.output_file, options.scores_file, stdin).items():
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
    inputs = _inputs(options)
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
    _refuse_overwriting_inputs(written, inputs)
    if stdin:
        hypotheses, stats = translate_stream(
            model, tokenizer, {**settings, "length_penalty": search["length_penalty"]}, output_file
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
    _refuse_overwriting_inputs({"--output_file": output_file, "--scores_file": scores_file}, inputs)
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


def decoding_settings(options: Options, config) -> dict[str, Any]:
    """The flags' decoding values, else the config's (config.eval); a bad config value names its key."""
    keys = ("beam_size", "alpha", "max_extra_len", "batch_size")
    from_config = {key: config.eval[key] for key in keys if getattr(options, key) is None}
    check_numbers(from_config, "config.eval.")
    settings = {key: from_config[key] if key in from_config else getattr(options, key) for key in keys}
    settings["max_input_len"] = config.data.eval_max_len
    return settings


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
    from transformer_jax.evaluation.translate import translate

    settings = {**settings, "batch_size": 1}  # one line at a time: nothing waits for a full batch
    if output_file:
        Path(output_file).parent.mkdir(parents=True, exist_ok=True)
    out = open(output_file, "w", encoding="utf-8") if output_file else sys.stdout
    hypotheses, totals = [], {}
    try:
        for line in _stdin_lines():
            [hyp], stats = translate(model, tokenizer, [line], **settings)
            out.write(hyp + "\n")
            out.flush()
            hypotheses.append(hyp)
            for key in ("sentences", "empty", "truncated", "hit_max_len", "src_tokens", "tgt_tokens", "seconds"):
                totals[key] = totals.get(key, 0) + stats[key]
    finally:
        if out is not sys.stdout:
            out.close()
    return hypotheses, totals


def _stdin_lines():
    """stdin's lines without line endings, decoded as strict UTF-8 (the terminal's own decoding may be lenient)."""
    from transformer_jax.evaluation import bleu

    binary = getattr(sys.stdin, "buffer", None)
    for number, raw in enumerate(binary if binary is not None else sys.stdin, start=1):
        if isinstance(raw, str):  # a text stream without a buffer: undecodable bytes came as surrogates
            try:
                raw = raw.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = raw.encode("utf-8", "surrogatepass")  # still invalid UTF-8, reported below
        try:
            [line] = bleu.decode_lines(raw, "stdin", EvalError, first_line=number)
        except EvalError as e:
            raise EvalError(f"{e}; the {number - 1} lines before it were translated") from None
        yield line.rstrip("\r")


def _write_lines(path: str, lines: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)


def _write_json(path: str, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")
