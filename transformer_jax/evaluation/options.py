"""What an evaluation run translates, with which checkpoints and settings (`Options`), checked in one place.

`check_options` finds everything a user can get wrong in the options (a flag value, an output that would overwrite
an input) without reading a file; `check_writable` and `check_folder_writable` test output locations without
leaving anything behind. evaluate.py, the export, the explanation page and the sweep share them.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from transformer_jax import config_checks, decoding, files
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation import modes
from transformer_jax.evaluation.translate import DecodeSettings

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
    finished: str | None = None  # in_beam | set_aside: beam search's rule for ended hypotheses (None: decoding.IN_BEAM)
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
    "finished",
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
        refuse_overwriting_inputs(
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
    outputs = output_files(o.output_file, o.scores_file, o.source_file == "-")
    if o.nbest is not None and o.output_file is not None:
        outputs["--nbest (OUTPUT_FILE.nbest)"] = f"{o.output_file}.nbest"
    refuse_overwriting_inputs(outputs, input_files(o))
    return dataclasses.replace(o, average_steps=average_steps, checkpoint=str(o.checkpoint))


def check_numbers(values: dict[str, Any], prefix: str) -> None:
    """EvalError for a decoding value that cannot work, by the rule of its config key (config_checks.RULES, the
    one source of allowed ranges); `prefix` + key is the name a user set it by (--beam_size, config.eval.alpha)."""
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


def input_files(o: Options) -> dict[str, str | None]:
    return {
        "--source_file": None if o.source_file == "-" else o.source_file,
        "--references_file": o.references_file,
        "--prefix_file": o.prefix_file,
    }


def output_files(output_file: str | None, scores_file: str | None, stdin: bool) -> dict[str, str | None]:
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


def refuse_overwriting_inputs(outputs: dict[str, str | None], inputs: dict[str, str | None]) -> None:
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
    try:
        files.probe_writable(folder, create=False)
    except NotADirectoryError as e:
        raise EvalError(f"{flag}: {e.strerror}, so {folder} cannot be created; choose another location") from e
    except OSError as e:
        raise EvalError(f"{flag}: cannot write in {folder} ({e.strerror or e}); choose another location") from e


def decoding_settings(options: Options, config) -> DecodeSettings:
    """translate()'s settings from the flags, else the config (config.eval); a bad config value names its key. The
    search is the flags' (decoding.search_for): --sampling (modes.sampling_of; beam size 1), else greedy or beam
    search with --length_penalty and --finished."""
    keys = ("beam_size", "alpha", "max_extra_len", "batch_size")
    from_config = {key: config.eval[key] for key in keys if getattr(options, key) is None}
    check_numbers(from_config, "config.eval.")
    settings = {key: from_config[key] if key in from_config else getattr(options, key) for key in keys}
    sampling = modes.sampling_of(options)
    search = decoding.search_for(
        1 if sampling is not None else settings["beam_size"],
        settings["alpha"],
        options.length_penalty or decoding.GNMT,
        options.finished or decoding.IN_BEAM,
        sampling,
        options.seed or 0,
    )
    return DecodeSettings(
        search=search,
        max_extra_len=settings["max_extra_len"],
        batch_size=settings["batch_size"],
        max_input_len=config.data.eval_max_len,
    )
