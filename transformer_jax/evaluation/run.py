"""Evaluation as a library: the frozen record of each mode (what evaluate.py's flags become: evaluation.command.parse)
runs here and returns data; nothing is printed or written (evaluation/command.py does that).

    scores_only(ScoresOnly) / compare(Compare)             -> the report
    load(Translate | ScorePairs)                           -> Loaded: the inputs read, the model restored
    translate(Translate, Loaded)                           -> Translation: hypotheses, n-best lists, report
    stream(Translate, Loaded, lines) then stream_result    -> stdin's translations one at a time, then the Translation
    score(ScorePairs, Loaded)                              -> Scored: each pair's log-probability, report
    Matrix                                                 -> evaluation/matrix.py

`load` reads and checks the inputs before it restores the model, so that a wrong file fails first.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from transformer_jax import cli, decoding
from transformer_jax.config import schema
from transformer_jax.data import languages
from transformer_jax.data.sources import open_split, read_all, resolve_path
from transformer_jax.decoding import PLAIN_SAMPLING, Ensemble
from transformer_jax.errors import ConfigError, EvalError
from transformer_jax.evaluation import significance
from transformer_jax.evaluation.restore import (
    LATEST,
    CheckpointChoice,
    restore_members,
    restore_model,
    workdir_tokenizer,
)
from transformer_jax.evaluation.scoring import SentenceScore, score_pairs
from transformer_jax.evaluation.translate import (
    DecodeSettings,
    Hypothesis,
    LanguageIds,
    check_line_counts,
    check_nbest,
    decode_lines,
    read_lines,
    score_all,
    score_files,
    translate_nbest,
)
from transformer_jax.evaluation.translate import translate as translate_sentences
from transformer_jax.training import checkpoints

UTILITIES = ("bleu", "chrf")  # MBR's utilities (`utility`)


# -- the mode records: what evaluate.py's flags become (evaluation.command.parse) ------------------------------------


@dataclasses.dataclass(frozen=True)
class Model:
    """Which model: a workdir's checkpoints (the steps averaged), and the ensemble's other members."""

    workdir: str
    config: Any = None  # ml_collections.ConfigDict, or None: the one saved with the checkpoints
    choice: CheckpointChoice = LATEST
    ensemble_workdirs: tuple[str, ...] | None = None  # more models decoding with workdir's (decoding/ensemble.py)
    # The language to translate into: a bilingual Marian model's >>lang<< source token (None: config.data.target_lang);
    # a multilingual model's language (data/languages.py; None: the one its directions translate into, if only one).
    target_lang: str | None = None
    source_lang: str | None = None  # a multilingual model's source language (its split file; its token if it has one)


@dataclasses.dataclass(frozen=True)
class ScoresOnly:
    """Score existing translations against references (no model)."""

    hypotheses_file: str
    references_file: str


@dataclasses.dataclass(frozen=True)
class Compare:
    """sacreBLEU's paired bootstrap test of a system's translations against a baseline's (no model)."""

    hypotheses_file: str
    compare_file: str  # the baseline
    references_file: str


@dataclasses.dataclass(frozen=True)
class Decoding:
    """How to decode: the search flags (None: config.eval's value, or decoding.PLAIN_SAMPLING's) and how to choose
    among a line's candidates. `parse` checks one as given (every unset flag None) before it fills the defaults."""

    beam_size: int | None = None
    alpha: float | None = None
    max_extra_len: int | None = None
    max_len: int | None = None
    batch_size: int | None = None
    length_penalty: str = decoding.GNMT
    finished: str = decoding.IN_BEAM  # (sampling does not search)
    nbest: int | None = None  # each line's N best also go to the n-best list
    sampling: bool = False
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    num_samples: int | None = None  # samples per line (with sampling)
    seed: int = 0
    mbr: int | None = None  # choose among this many candidates by expected utility (run.mbr_choice)
    mbr_utility: str | None = None  # with mbr

    @property
    def candidates(self) -> int:
        """How many hypotheses each line's search gives: the n-best, the samples, or MBR's candidates."""
        return self.mbr or self.nbest or self.num_samples or 1


@dataclasses.dataclass(frozen=True)
class Translate:
    """Translate a split, a file or stdin (source_file '-') with a model, and score it when there are references."""

    model: Model
    split: str | None = None  # None with a source_file
    source_file: str | None = None
    references_file: str | None = None  # with a source_file (a split brings its own)
    prefix_file: str | None = None
    decoding: Decoding = Decoding()
    text_dir: str | None = None  # the split's {split}.{lang} files are read here instead of data.text_dir

    @property
    def stdin(self) -> bool:
        return self.source_file == "-"


@dataclasses.dataclass(frozen=True)
class ScorePairs:
    """Forced decoding: the model's log P(reference | source) of each pair of a split or of two files."""

    model: Model
    split: str | None = None
    source_file: str | None = None
    references_file: str | None = None
    batch_size: int | None = None  # None: config.eval.batch_size
    text_dir: str | None = None  # as Translate's


@dataclasses.dataclass(frozen=True)
class Matrix:
    """A multilingual model's language matrix: every direction between the languages of a multi-way folder
    (evaluation/matrix.py runs it)."""

    model: Model
    directions: tuple[str, ...]  # ("all",) or SRC-TGT names
    split: str = "test"  # the files {split}.{lang}; valid and test: data.valid_split and data.test_split
    text_dir: str | None = None  # None: config.data.text_dir
    pivot: str | None = None  # also translate the zero-shot directions through this language
    decoding: Decoding = Decoding()  # beam search only


Mode = ScoresOnly | Compare | Translate | ScorePairs | Matrix


def check_numbers(values: dict[str, Any], prefix: str) -> None:
    """EvalError for a decoding value that cannot work, by the rule of its config key (schema.RULES, the
    one source of allowed ranges); `prefix` + key is the name a user set it by (--beam_size, config.eval.alpha)."""
    for key, value in values.items():
        if value is None:
            continue
        try:
            schema.RULES[f"eval.{key}"].check(f"eval.{key}", value, name=f"{prefix}{key}")
        except ConfigError as e:
            raise EvalError(str(e)) from e


def input_files(mode: Translate | ScorePairs) -> dict[str, str | None]:
    """The files a model mode reads, by flag (a split's files are known once its config is: run.split_files)."""
    return {
        "--source_file": None if mode.source_file == "-" else mode.source_file,
        "--references_file": mode.references_file,
        "--prefix_file": getattr(mode, "prefix_file", None),
    }


def sampling_of(d: Decoding) -> decoding.Sampling | None:
    """The decoding.Sampling the flags ask for (unset ones: decoding.PLAIN_SAMPLING's), or None without --sampling."""
    if not d.sampling:
        return None
    given = {k: getattr(d, k) for k in ("temperature", "top_k", "top_p") if getattr(d, k) is not None}
    return dataclasses.replace(PLAIN_SAMPLING, **given)


STREAM_STATS = ("sentences", "empty", "truncated", "hit_max_len", "src_tokens", "tgt_tokens", "seconds")


def scores_only(mode: ScoresOnly) -> dict[str, Any]:
    return {**dataclasses.asdict(mode), **score_files(mode.hypotheses_file, mode.references_file)}


def compare(mode: Compare) -> dict[str, Any]:
    """sacreBLEU's paired bootstrap test of the hypotheses against the baseline (significance.py)."""
    result = significance.compare_files(mode.hypotheses_file, mode.compare_file, mode.references_file)
    return {**dataclasses.asdict(mode), "comparison": result}


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model mode's inputs, read and checked, and its model, restored."""

    config: Any
    model: Any  # in eval mode; an Ensemble with --ensemble_workdirs
    tokenizer: Any
    steps: list[int]  # the checkpoint steps averaged
    name: str  # the source: the file's name, "stdin", or split(name)
    sources: list[str] | None  # None for stdin
    references: list[str] | None
    prefixes: list[str] | None
    inputs: dict[str, str | None]  # every file read, by the flag (or split) it came from
    language_ids: LanguageIds | None = None  # a multilingual model's direction (translate.LanguageIds)

    @property
    def tag(self) -> str:
        """The checkpoints, as output file names carry them: step300, or step300-avg2."""
        return f"step{self.steps[-1]}" + (f"-avg{len(self.steps)}" if len(self.steps) > 1 else "")


def load(mode: Translate | ScorePairs) -> Loaded:
    """Reads and checks the inputs, then restores the model (and the ensemble's members)."""
    m = mode.model
    if m.config is not None:  # a --config the user gave; the one saved with the checkpoints was checked
        cli.validate(m.config)
    references = read_lines(mode.references_file) if mode.references_file else None
    sources = None
    if mode.source_file and mode.source_file != "-":
        sources = read_sources(mode.source_file)
        if references is not None:
            check_line_counts(sources, references, mode.source_file, mode.references_file)
        if not sources:
            raise EvalError(f"--source_file {mode.source_file} has no lines: nothing to translate")
    prefix_file = getattr(mode, "prefix_file", None)
    prefixes = read_sources(prefix_file) if prefix_file is not None else None
    if prefixes is not None and sources is not None:
        check_prefix_count(prefixes, sources, prefix_file, mode.source_file)

    for workdir in m.ensemble_workdirs or ():  # cheap, before any model is restored
        if not checkpoints.list_steps(workdir):
            raise EvalError(f"--ensemble_workdirs member {workdir} has no checkpoint; train it first or drop it")
    config, model, steps = restore_model(m.workdir, m.choice, config=m.config)
    config = with_text_dir(config, mode.text_dir)
    direction = None
    if config.data.directions or config.model.get("language_codes"):
        direction = direction_of(config, m, given_file=mode.source_file is not None)
    elif m.source_lang is not None:
        raise EvalError(
            f"--source_lang: {m.workdir} holds a bilingual model ({config.data.src_lang}-{config.data.tgt_lang}); "
            "drop --source_lang"
        )
    elif m.target_lang is not None:  # --target_lang: the sources' >>lang<< token instead of data.target_lang's
        config = config.copy_and_resolve_references()
        with config.unlocked():
            config.data.target_lang = m.target_lang
    tokenizer = workdir_tokenizer(config, m.workdir)
    language_ids = None
    if direction is not None:
        language_ids = LanguageIds.of(languages.Placement.of(config), direction)
        if mode.source_file is None:  # the split's files of this direction's two languages
            config = config.copy_and_resolve_references()
            with config.unlocked():
                config.data.src_lang, config.data.tgt_lang = direction.src, direction.tgt
    if m.ensemble_workdirs:
        model = Ensemble([model, *restore_members(m.ensemble_workdirs, config, tokenizer)])
    inputs = input_files(mode)
    if mode.source_file is None:
        sources, references, split_name = split_pairs(config, mode.split)
        name = f"{mode.split}({split_name}{'' if direction is None else '.' + direction.name})"
        if prefixes is not None:
            check_prefix_count(prefixes, sources, prefix_file, f"--split {mode.split}")
        inputs.update(split_files(config, split_name))
    else:
        name = "stdin" if mode.source_file == "-" else Path(mode.source_file).name
        if direction is not None:
            name += f".{direction.name if direction.src else 'to-' + direction.tgt}"
    return Loaded(config, model, tokenizer, steps, name, sources, references, prefixes, inputs, language_ids)


def with_text_dir(config: Any, text_dir: str | None) -> Any:
    """The config reading its splits from `text_dir` (--text_dir: a folder of {split}.{lang} files), or as it is."""
    if text_dir is None:
        return config
    if not Path(text_dir).expanduser().is_dir():
        raise EvalError(f"--text_dir {text_dir} is not a directory; give the folder of {{split}}.{{lang}} files")
    config = config.copy_and_resolve_references()
    with config.unlocked():
        config.data.source, config.data.text_dir = "text", str(text_dir)
    return config


def direction_of(config: Any, model: Model, *, given_file: bool) -> languages.Direction:
    """The direction a multilingual model translates in (--source_lang, --target_lang; each defaults to the only
    one its directions have), checked against its language tokens (a converted model's codes resolve a language's
    names: languages.resolve). A file's source language matters only to a model whose sources carry their own
    language's token (model.lang_token=source_and_target): elsewhere it is refused (it would change nothing) and the
    direction's source is empty; a split needs it for its file. A converted model without data.directions has no
    trained direction, so both languages must be given (transformers silently assumes English)."""
    trained = languages.directions(config.data)
    known = languages.languages(config.data)
    placement = languages.Placement.of(config)
    scheme = config.model.lang_token
    own_token = scheme == "source_and_target"

    def language(flag: str, given: str | None, choices: list[str]) -> str:
        if given is None:
            if len(set(choices)) == 1:
                return choices[0]
            if not trained:
                raise EvalError(
                    f"{model.workdir} holds a converted model, which has no trained direction: give --{flag} "
                    "(converted models require a source language and a target language)"
                )
            raise EvalError(
                f"{model.workdir} holds a multilingual model (data.directions {', '.join(config.data.directions)}): "
                f"give --{flag}, one of {', '.join(known)}"
            )
        name = given[2:-2] if given.startswith(">>") and given.endswith("<<") else given
        try:
            placement.code_of(name)
        except ConfigError as e:
            if config.model.get("language_codes"):
                raise EvalError(f"--{flag} {given}: {e}") from None
            raise EvalError(
                f"--{flag} {given}: the model of {model.workdir} has no token for it; it has "
                f"{', '.join(f'{x} ({languages.code(x)})' for x in known)}"
            ) from None
        return name

    if given_file and not own_token and model.source_lang is not None:
        raise EvalError(
            f"--source_lang: the sources of {model.workdir}'s model carry no language token of their own "
            f"(model.lang_token={scheme}), so a file's language changes nothing; drop --source_lang"
        )
    tgt = language("target_lang", model.target_lang, [d.tgt for d in trained])
    if given_file and not own_token:
        return languages.Direction("", tgt)  # no source token: its language is not needed
    # A split's source file defaults to the only language trained into tgt; a file's language, to the only source
    # language the model has (its token describes the input: it is never guessed among several).
    sources = [d.src for d in trained if d.tgt == tgt or given_file]
    src = language("source_lang", model.source_lang, sources or known)
    if placement.code_of(src) == placement.code_of(tgt):
        raise EvalError(
            f"--source_lang and --target_lang are both {placement.code_of(src)}: give two different languages"
        )
    return languages.Direction(src, tgt)


@dataclasses.dataclass(frozen=True)
class Translation:
    """A translation's outputs: one hypothesis per line, each line's candidates when it has several, the report."""

    hypotheses: list[str]
    lists: list[list[Hypothesis]] | None  # the n-best lists or samples (best first); None for one candidate a line
    report: dict[str, Any]


def settings_of(mode: Translate, loaded: Loaded) -> tuple[DecodeSettings, dict[str, Any]]:
    """(translate()'s settings, the report's account of the search); an n-best list longer than the config's beam is
    refused here."""
    d = mode.decoding
    settings = decoding_settings(d, loaded.config)
    search: dict[str, Any] = {"length_penalty": d.length_penalty, "nbest": d.candidates}
    if d.sampling:
        search["sampling"] = {**dataclasses.asdict(sampling_of(d)), "seed": d.seed, "num_samples": d.candidates}
    else:
        search["finished"] = d.finished
        if d.candidates > 1:
            check_nbest(d.candidates, settings.search.beam_size, "--mbr" if d.mbr is not None else "--nbest")
    if d.mbr is not None:
        search["mbr_utility"] = d.mbr_utility
    return settings, search


def decoding_settings(options: Decoding, config) -> DecodeSettings:
    """translate()'s settings from the flags, else config.eval (a bad config value names its key)."""
    keys = ("beam_size", "alpha", "max_extra_len", "max_len", "batch_size")
    from_config = {key: config.eval[key] for key in keys if getattr(options, key) is None}
    check_numbers(from_config, "config.eval.")
    settings = {key: from_config[key] if key in from_config else getattr(options, key) for key in keys}
    sampling = sampling_of(options)
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
        max_len=settings["max_len"],
        batch_size=settings["batch_size"],
        max_input_len=config.data.eval_max_len,
    )


def output_name(mode: Translate, loaded: Loaded) -> str:
    """The default name of a translation's outputs: source, checkpoints (marked -best when chosen by score), and the
    search (test(x).step300-avg2.beam4, test(x).step300-best.beam4-mbr8, test(x).step300.sample4-seed0), so that
    evaluations that differ in these never write over each other's outputs."""
    settings, _ = settings_of(mode, loaded)
    d, m = mode.decoding, mode.model
    chosen = "-best" if m.choice.by_score else ""
    search = f"sample{d.candidates}-seed{d.seed}" if d.sampling else f"beam{settings.search.beam_size}"
    if d.mbr is not None:
        search += f"-mbr{d.mbr}"
    return f"{loaded.name}.{loaded.tag}{chosen}.{search}"


def translate(mode: Translate, loaded: Loaded, *, progress: bool = False) -> Translation:
    """Translates the loaded sources (not stdin: `stream`) and scores them when there are references; `progress`: a
    progress bar on stderr."""
    if mode.stdin:
        raise ValueError("stdin is translated one line at a time: use stream()")
    d = mode.decoding
    settings, search = settings_of(mode, loaded)
    lists, stats = translate_nbest(
        loaded.model,
        loaded.tokenizer,
        loaded.sources,
        settings,
        nbest=search["nbest"],
        prefixes=loaded.prefixes,
        progress=progress,
        language_ids=loaded.language_ids,
    )
    hypotheses = [x[0].text for x in lists]
    if d.mbr is not None:
        u = utility(d.mbr_utility)
        hypotheses = [x[mbr_choice([h.text for h in x], u)].text for x in lists]
    has_lists = d.nbest is not None or d.candidates > 1
    return Translation(
        hypotheses, lists if has_lists else None, _report(mode, loaded, settings, search, hypotheses, stats)
    )


def stream(mode: Translate, loaded: Loaded, lines: Iterable[str]) -> Iterator[tuple[str, dict[str, Any]]]:
    """Each line's translation and statistics as soon as it is ready (batches of one: nothing waits for a full
    batch); `stream_result` makes the Translation of them."""
    settings, _ = settings_of(mode, loaded)
    settings = dataclasses.replace(settings, batch_size=1)
    for line in lines:
        [hypothesis], stats = translate_sentences(
            loaded.model, loaded.tokenizer, [line], settings, language_ids=loaded.language_ids
        )
        yield hypothesis, stats


def stream_result(mode: Translate, loaded: Loaded, results: list[tuple[str, dict[str, Any]]]) -> Translation:
    if not results:
        raise EvalError("stdin had no lines: nothing was translated")
    hypotheses = [h for h, _ in results]
    if loaded.references is not None:
        check_line_counts(hypotheses, loaded.references, "stdin", mode.references_file)
    totals = {key: sum(stats[key] for _, stats in results) for key in STREAM_STATS}
    settings, search = settings_of(mode, loaded)
    return Translation(hypotheses, None, _report(mode, loaded, settings, search, hypotheses, totals))


def _report(
    mode: Translate, loaded: Loaded, settings: DecodeSettings, search: dict, hypotheses: list[str], stats: dict
) -> dict[str, Any]:
    references = loaded.references
    return {
        "workdir": mode.model.workdir,
        "checkpoint_steps": loaded.steps,
        "source": loaded.name,
        "references_file": mode.references_file,
        "decoding": settings.report(),
        "search": search,
        "lines": len(hypotheses),
        "blank_lines": {
            "sources": stats["empty"],
            "references": sum(not r.strip() for r in references) if references is not None else None,
        },
        "stats": stats,
        "scores": score_all(hypotheses, references) if references is not None else None,
    }


@dataclasses.dataclass(frozen=True)
class Scored:
    """Forced decoding's outputs: each pair's log-probability and the report."""

    scores: list[SentenceScore]
    report: dict[str, Any]


def score(mode: ScorePairs, loaded: Loaded, *, progress: bool = False) -> Scored:
    batch_size = mode.batch_size
    if batch_size is None:
        batch_size = loaded.config.eval.batch_size
        check_numbers({"batch_size": batch_size}, "config.eval.")
    scores, stats = score_pairs(
        loaded.model,
        loaded.tokenizer,
        loaded.sources,
        loaded.references,
        batch_size=batch_size,
        max_len=loaded.config.data.eval_max_len,
        progress=progress,
        language_ids=loaded.language_ids,
    )
    report = {
        "workdir": mode.model.workdir,
        "source": f"{loaded.name}.{loaded.tag}",
        "references_file": mode.references_file,
        "lines": len(scores),
        "scoring": stats,
    }
    return Scored(scores, report)


def lines_summary(lines: int, blank: dict[str, int | None]) -> str:
    text = f"{lines} lines translated, one hypothesis each; blank source lines: {blank['sources']} (empty hypotheses)"
    if blank["references"] is None:
        return text + "; no references, not scored"
    return (
        text + f"; blank reference lines: {blank['references']}; all {lines} lines scored, as the sacrebleu command "
        "scores them (an empty hypothesis matches nothing; its reference still counts in the reference length)"
    )


# -- the inputs: a UTF-8 file, a split of the configured data, or stdin line by line --------------------------------


def read_sources(path: str) -> list[str]:
    """Lines of a UTF-8 file split at LF only, each with its line ending removed (nothing else); a leading
    byte-order mark is dropped (`sources.leading_bom`): it is no part of the first sentence."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e.strerror or e}") from e
    return [line.rstrip("\r") for line in decode_lines(data, path, EvalError)]


def split_name(config: Any, split: str) -> str:
    """The files' name of --split: `valid` and `test` are the config's data.valid_split and data.test_split; any
    other name is a split of the text folder as it is."""
    return {"valid": config.data.valid_split, "test": config.data.test_split}.get(split, split)


def split_pairs(config, split: str) -> tuple[list[str], list[str], str]:
    """Every line of the split, blank ones included: evaluation gives one hypothesis per source line."""
    name = split_name(config, split)
    pairs = read_all(open_split(config.data, name, keep_blank=True))
    if not pairs:
        raise EvalError(f"split {name!r} of data.source={config.data.source} has no lines: nothing to translate")
    return [s for s, _ in pairs], [t for _, t in pairs], name


def split_files(config, split_name: str) -> dict[str, str]:
    """The files a text split is read from (for the output-is-not-an-input check)."""
    if config.data.source != "text":
        return {}
    directory = resolve_path(config.data.text_dir)
    return {
        f"split file ({lang})": str(directory / f"{split_name}.{lang}")
        for lang in (config.data.src_lang, config.data.tgt_lang)
    }


def stdin_lines() -> Iterator[str]:
    """stdin's lines without line endings, decoded as strict UTF-8 (the terminal's own decoding may be lenient)."""
    binary = getattr(sys.stdin, "buffer", None)
    for number, raw in enumerate(binary if binary is not None else sys.stdin, start=1):
        if isinstance(raw, str):  # a text stream without a buffer: undecodable bytes came as surrogates
            try:
                raw = raw.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:
                raw = raw.encode("utf-8", "surrogatepass")  # still invalid UTF-8, reported below
        try:
            [line] = decode_lines(raw, "stdin", EvalError, first_line=number)
        except EvalError as e:
            raise EvalError(f"{e}; the {number - 1} lines before it were translated") from None
        yield line.rstrip("\r")


def check_prefix_count(prefixes: Sequence[str], sources: Sequence[str], prefix_name: str, source_name: str) -> None:
    """EvalError unless there is one prefix line per source line."""
    if len(prefixes) != len(sources):
        raise EvalError(
            f"line counts differ: --prefix_file {prefix_name} has {len(prefixes)} lines, {source_name} has "
            f"{len(sources)}; give one prefix line per source line (an empty line for none)"
        )


# -- minimum Bayes risk decoding (Freitag et al., 2022): among a line's N candidates (an n-best list or samples),
# the one with the highest expected utility, the other candidates standing in for references drawn from the model:
#     argmax_i  1/(N-1) sum_{j != i} u(h_i, h_j)
# with u sacrebleu's sentence BLEU or chrF. A candidate scored against itself would add the same maximum to every
# candidate, so it is left out. Ties go to the earlier candidate (the better-ranked one).


def utility(name: str) -> Callable[[str, str], float]:
    """u(hypothesis, reference) by name: sentence BLEU (effective order, so short sentences are not all 0) or chrF."""
    if name == "bleu":
        metric = BLEU(effective_order=True)
    elif name == "chrf":
        metric = CHRF()
    else:
        raise ValueError(f"unknown MBR utility {name!r}; expected one of {', '.join(UTILITIES)}")
    return lambda hypothesis, reference: metric.sentence_score(hypothesis, [reference]).score


def expected_utilities(candidates: Sequence[str], u: Callable[[str, str], float]) -> list[float]:
    """Each candidate's mean utility against the others (a single candidate: 0)."""
    n = len(candidates)
    if n < 2:
        return [0.0] * n
    return [sum(u(h, r) for j, r in enumerate(candidates) if j != i) / (n - 1) for i, h in enumerate(candidates)]


def mbr_choice(candidates: Sequence[str], u: Callable[[str, str], float]) -> int:
    scores = expected_utilities(candidates, u)
    return max(range(len(candidates)), key=lambda i: (scores[i], -i))
