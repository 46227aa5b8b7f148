"""The language matrix of a multilingual model: every direction between the languages of a multi-way folder
(`{split}.{lang}`, line i the same sentence in every language), translated in one search whose batches mix the
directions (one LanguageIds per line), each scored against the folder's own lines.

    check(Matrix) -> Plan          the folder, languages and directions, checked before any model is restored
    restore(Matrix) -> run.Loaded  the model
    translate(Plan, Loaded) -> Result: every output, report (by direction), meta

Directions: `all` (every ordered pair of the folder's languages that the model has a token for; the folder's other
languages are listed and skipped) or SRC-TGT names. A converted model's codes (model.language_codes) resolve the
folder's suffixes (languages.resolve: `en` -> `eng_Latn`); files and directions keep the suffixes. A direction is
supervised when config.data.directions or train.init_from's sources trained it (train.source_directions), zero-shot
otherwise (every direction of a converted model that was not fine-tuned). With a pivot P, every zero-shot direction S-T
without P is also translated S->P, then P->T with the same model (each leg one search mixing all of them; S->P's outputs
are the matrix's own when it holds S-P): the baseline every zero-shot paper reports.

Scores: sacreBLEU corpus BLEU and chrF (BLEU(), CHRF(): the `sacrebleu` command's defaults, as score_all) of the
outputs against the target language's lines, every line counted (a blank source gives a blank output).

Off-target rate: the share of a direction's non-blank outputs that py3langid (langid.py, Lui and Baldwin 2012),
restricted to the model's languages that it knows, identifies as another language than the target. None where it
cannot say: the target is not a language py3langid knows (a synthetic suffix), fewer than two of the model's
languages are known to it, or the direction has no non-blank output.

The command (evaluation/command.py) writes `meta.json` first (everything that is not a direction: checkpoints, split,
folder, languages skipped and unidentifiable, settings; it marks the folder as a matrix's), then Result.outputs as
`<name>.txt` files, `heatmap.png` and `report.json` (keys: direction names `src-tgt` only, each {bleu, chrf,
off_target, supervised, pivot: {bleu, chrf, off_target} | None, lines}).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sacrebleu.metrics import BLEU, CHRF

from transformer_jax import cli, runtime
from transformer_jax.data import languages
from transformer_jax.data.languages import Direction
from transformer_jax.data.sources import resolve_path
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import run
from transformer_jax.evaluation.restore import restore_model, saved_config, workdir_tokenizer
from transformer_jax.evaluation.translate import LanguageIds
from transformer_jax.evaluation.translate import translate as translate_sentences

REPORT, META, HEATMAP = "report.json", "meta.json", "heatmap.png"
ZERO_SHOT_MARK = "*"


@dataclasses.dataclass(frozen=True)
class Plan:
    """What a matrix translates: checked, its files read."""

    split: str  # the files' prefix: {split}.{lang}
    text_dir: Path
    model_languages: list[str]  # those the model has a token for, sorted (a converted model's: the folder's)
    languages: list[str]  # the directions' languages (all: the folder's with a token), sorted: rows and columns
    skipped: list[str]  # the folder's languages without a token
    directions: list[Direction]
    supervised: frozenset[str]  # the directions the model was trained on (languages.trained)
    pivot: str | None
    pivoted: list[Direction]  # the zero-shot directions also translated through the pivot
    lines: dict[str, list[str]]  # each language's lines (sources and references)


def check(mode: run.Matrix) -> Plan:
    """The Plan of `mode`, or EvalError naming the flag and what to do; reads the saved config and the folder's files,
    restores no model."""
    if mode.model.config is not None:  # a --config the user gave; the one saved with the checkpoints was checked
        cli.validate(mode.model.config)
    config = saved_config(mode.model.workdir, mode.model.config)
    converted = bool(config.model.get("language_codes"))  # its codes, not the folder's suffixes
    if not config.data.directions and not converted:
        raise EvalError(
            f"--directions: {mode.model.workdir} holds a bilingual model ({config.data.src_lang}-"
            f"{config.data.tgt_lang}); translate it with --split or --source_file, without --directions"
        )
    placement = languages.Placement.of(config)
    split = run.split_name(config, mode.split)
    where = mode.text_dir or config.data.text_dir
    flag = "--text_dir" if mode.text_dir else "config.data.text_dir (set --text_dir)"
    if not where:
        raise EvalError("--directions needs a multi-way folder of {split}.{lang} files: give --text_dir")
    text_dir = resolve_path(where)
    if not text_dir.is_dir():
        raise EvalError(f"{flag} {text_dir} is not a folder; give the multi-way folder of {{split}}.{{lang}} files")
    found = sorted(f.name[len(split) + 1 :] for f in text_dir.glob(f"{split}.*") if f.is_file())
    if not found:
        there = sorted(f.name for f in text_dir.iterdir() if f.is_file())[:20]
        raise EvalError(f"{flag} {text_dir} has no files of split {split!r} ({split}.LANG); it holds {there}")
    langs = [lang for lang in found if placement.has(lang)]
    known = langs if converted else sorted(placement.ids)  # the model's languages, as the folder names them
    directions = parse_directions(mode.directions, langs, placement, f"{text_dir}/{split}.*")
    if not directions:
        raise EvalError(
            f"{flag} {text_dir} has split {split!r} in {found}, of which the model has tokens for {langs}: a matrix "
            f"needs two; the model's languages are {_listed(placement)}"
        )
    if mode.pivot is not None and not placement.has(mode.pivot):
        raise EvalError(f"--pivot {mode.pivot}: the model has no token for it; choose one of {_listed(placement)}")
    supervised = frozenset(languages.trained(config))
    zero_shot = [d for d in directions if d.name not in supervised]
    pivoted = [] if mode.pivot is None else [d for d in zero_shot if mode.pivot not in (d.src, d.tgt)]
    used = sorted({lang for d in directions for lang in (d.src, d.tgt)})
    paths = languages.multiway_sides(text_dir, split, used)  # one line count for all
    lines = {lang: run.read_sources(str(path)) for lang, path in paths.items()}
    if not lines[used[0]]:
        raise EvalError(f"{paths[used[0]]} has no lines: nothing to translate")
    skipped = [lang for lang in found if lang not in langs]
    return Plan(split, text_dir, known, used, skipped, directions, supervised, mode.pivot, pivoted, lines)


def _listed(placement: languages.Placement) -> str:
    """The model's languages in an error message: all of a run's, a few of a converted model's codes."""
    names = sorted(placement.ids)
    return str(names) if len(names) <= 12 else f"{names[:8]} ... ({len(names)} codes)"


def parse_directions(
    entries: Sequence[str], langs: list[str], placement: languages.Placement, where: str
) -> list[Direction]:
    """`all` (every ordered pair of `langs`: none for fewer than two) or SRC-TGT names, each once, in order;
    EvalError for a language the model has no token for (`placement`) or that has no file (`langs`)."""
    if tuple(entries) == (languages.ALL,):
        return [Direction(s, t) for s, t in itertools.permutations(langs, 2)]
    out: list[Direction] = []
    for entry in entries:
        src, dash, tgt = entry.partition("-")
        if not dash or not src or not tgt or "-" in tgt or src == tgt:
            raise EvalError(f"--directions {entry!r}: give all, or SRC-TGT names of two languages joined by commas")
        for lang in (src, tgt):
            if not placement.has(lang):
                raise EvalError(
                    f"--directions {entry}: the model has no token for {lang!r}; it has {_listed(placement)}"
                )
            if lang not in langs:
                raise EvalError(f"--directions {entry}: no file for {lang!r} among {where}; there are {langs}")
        if Direction(src, tgt) not in out:
            out.append(Direction(src, tgt))
    return out


def restore(mode: run.Matrix) -> run.Loaded:
    """The model of mode's checkpoints, its tokenizer (with the language tokens), the steps averaged."""
    m = mode.model
    config, model, steps = restore_model(m.workdir, m.choice, config=m.config)
    tokenizer = workdir_tokenizer(config, m.workdir)
    return run.Loaded(config, model, tokenizer, steps, f"matrix.{mode.split}", None, None, None, {})


class Identifier:
    """py3langid's identifier restricted to `langs` (those it knows; a model's own instance, never the module's)."""

    def __init__(self, langs: Sequence[str]):
        from py3langid.langid import MODEL_FILE, LanguageIdentifier  # here: it reads its model (~0.3 s)

        self._identifier = LanguageIdentifier.from_model_file(MODEL_FILE)
        labels = set(self._identifier.labels)
        self.known = [lang for lang in langs if lang in labels]
        self.unknown = [lang for lang in langs if lang not in labels]
        if len(self.known) >= 2:
            self._identifier.set_languages(self.known)
        else:  # one candidate identifies nothing
            self._identifier = None

    def language(self, text: str) -> str:
        return self._identifier.classify(text)[0]

    def counts(self, hypotheses: Sequence[str]) -> dict[str, int] | None:
        """How many non-blank hypotheses are identified as each language (None: it identifies nothing)."""
        if self._identifier is None:
            return None
        return dict(collections.Counter(self.language(h) for h in hypotheses if h.strip()).most_common())

    def off_target(self, hypotheses: Sequence[str], target: str) -> float | None:
        """The share of the non-blank hypotheses identified as another language than `target` (None: cannot say)."""
        said = [h for h in hypotheses if h.strip()]
        if self._identifier is None or target not in self.known or not said:
            return None
        return sum(self.language(h) != target for h in said) / len(said)


@dataclasses.dataclass(frozen=True)
class Result:
    outputs: dict[str, list[str]]  # by file stem: src-tgt, src-pivot, src-pivot-tgt
    report: dict[str, dict[str, Any]]  # by direction name
    meta: dict[str, Any]  # everything else


def translate(mode: run.Matrix, plan: Plan, loaded: run.Loaded, *, progress: bool = False) -> Result:
    """Every direction of the plan in one search (and the pivot's two legs, one search each), scored."""
    settings = run.decoding_settings(mode.decoding, loaded.config)
    placement = languages.Placement.of(loaded.config)

    def search(jobs: list[tuple[Direction, list[str]]]) -> tuple[list[list[str]], dict[str, Any]]:
        """Each job's outputs: one translate() call whose lines carry their own direction's tokens."""
        if not jobs:
            return [], {}
        sentences = [line for _, lines in jobs for line in lines]
        ids = [LanguageIds.of(placement, d) for d, lines in jobs for _ in lines]
        found, stats = translate_sentences(
            loaded.model, loaded.tokenizer, sentences, settings, language_ids=ids, progress=progress
        )
        starts = list(itertools.accumulate([len(lines) for _, lines in jobs], initial=0))
        return [found[a:b] for a, b in itertools.pairwise(starts)], stats

    direct, stats = search([(d, plan.lines[d.src]) for d in plan.directions])
    outputs = {d.name: hyps for d, hyps in zip(plan.directions, direct, strict=True)}
    via: dict[str, list[str]] = {}
    legs: dict[str, Any] = {}
    if plan.pivoted:
        p = plan.pivot
        first = [Direction(src, p) for src in dict.fromkeys(d.src for d in plan.pivoted)]
        new = [d for d in first if d.name not in outputs]  # S-P is translated once, by the matrix when it holds it
        found, legs["to_pivot"] = search([(d, plan.lines[d.src]) for d in new])
        outputs.update({d.name: hyps for d, hyps in zip(new, found, strict=True)})
        found, legs["from_pivot"] = search([(Direction(p, d.tgt), outputs[f"{d.src}-{p}"]) for d in plan.pivoted])
        via = {d.name: hyps for d, hyps in zip(plan.pivoted, found, strict=True)}
        outputs.update({f"{d.src}-{p}-{d.tgt}": via[d.name] for d in plan.pivoted})

    identifier = Identifier(plan.model_languages)
    report = {}
    for d in plan.directions:
        references = [line.rstrip() for line in plan.lines[d.tgt]]
        pivot = None if d.name not in via else scores(via[d.name], references, d.tgt, identifier)
        report[d.name] = {
            **scores(outputs[d.name], references, d.tgt, identifier),
            "supervised": d.name in plan.supervised,
            "pivot": pivot,
            "lines": len(references),
        }
    meta = {
        "workdir": mode.model.workdir,
        "checkpoint_steps": loaded.steps,
        "split": plan.split,
        "text_dir": str(plan.text_dir),
        "languages": plan.languages,
        "skipped_languages": plan.skipped,  # in the folder, but the model has no token for them
        "model_languages": plan.model_languages,
        "unidentifiable_languages": identifier.unknown,  # py3langid does not know them: off_target None
        "identified_among": identifier.known if len(identifier.known) >= 2 else [],
        # where the off-target outputs went: each output file's non-blank lines by identified language
        "identified_languages": {
            name: identifier.counts([h.rstrip() for h in lines]) for name, lines in outputs.items()
        },
        "supervised_directions": sorted(plan.supervised),
        "pivot": plan.pivot,
        "decoding": settings.report(),
        "search": {"length_penalty": mode.decoding.length_penalty, "finished": mode.decoding.finished},
        "stats": {"direct": stats, **legs},
    }
    return Result(outputs, report, meta)


def scores(outputs: list[str], references: list[str], target: str, identifier: Identifier) -> dict[str, Any]:
    """{bleu, chrf, off_target} of one direction's outputs, as the `sacrebleu` command reads them from the written
    file (trailing blanks stripped, as translate.read_lines)."""
    hypotheses = [h.rstrip() for h in outputs]
    return {
        "bleu": BLEU().corpus_score(hypotheses, [references]).score,
        "chrf": CHRF().corpus_score(hypotheses, [references]).score,
        "off_target": identifier.off_target(hypotheses, target),
    }


# -- what the command writes and shows: the folder, the tables and the heatmap -----------------------------------------


def check_folder(folder: Path, flag: str) -> None:
    """EvalError unless `folder` can hold a matrix: new, empty, or a previous matrix's (it holds meta.json, written
    first), whose files of the same names are written over."""
    if folder.exists() and not folder.is_dir():
        raise EvalError(f"{flag} {folder} is a file; give a folder")
    if folder.is_dir() and any(folder.iterdir()) and not (folder / META).is_file():
        raise EvalError(
            f"{flag} {folder} holds files that are not a matrix's (no {META}); choose a new or empty folder"
        )


def write(result: Result, plan: Plan, folder: Path) -> list[str]:
    """Writes meta.json (first: it marks the folder as a matrix's), every output as `<name>.txt` and heatmap.png;
    returns the summary lines to print (the command writes report.json with them)."""
    folder.mkdir(parents=True, exist_ok=True)
    runtime.write_json(folder / META, result.meta)
    for name, lines in result.outputs.items():
        runtime.write_lines(folder / f"{name}.txt", lines)
    heatmap(result.report, plan.languages, folder / HEATMAP)
    summary = [f"{len(plan.directions)} directions of {plan.text_dir}/{plan.split}.{{{','.join(plan.languages)}}}"]
    if plan.skipped:
        summary.append(f"skipped (the model has no token for them): {', '.join(plan.skipped)}")
    unknown = result.meta["unidentifiable_languages"]
    if unknown:
        summary.append(f"not identifiable by py3langid (off-target -): {', '.join(unknown)}")
    return [*summary, tables(result.report, plan.languages, plan.pivot), f"outputs, {META}: {folder}"]


def tables(report: dict[str, dict[str, Any]], langs: Sequence[str], pivot: str | None = None) -> str:
    """BLEU/chrF and the off-target rate (%), rows the source, columns the target, zero-shot cells marked `*`
    (and through the pivot, for the directions it translated)."""
    parts = [
        _table(report, langs, "BLEU/chrF (rows: source, columns: target; * zero-shot)", lambda r: _pair(r)),
        _table(report, langs, "off-target % (py3langid; - : cannot identify)", lambda r: _percent(r["off_target"])),
    ]
    if pivot is not None and any(r["pivot"] for r in report.values()):
        parts += [
            _table(report, langs, f"through {pivot}: BLEU/chrF", lambda r: _pair(r["pivot"]) if r["pivot"] else ""),
            _table(
                report,
                langs,
                f"through {pivot}: off-target %",
                lambda r: _percent(r["pivot"]["off_target"]) if r["pivot"] else "",
            ),
        ]
    return "\n\n".join(parts)


def _pair(scores: dict[str, Any]) -> str:
    return f"{scores['bleu']:.1f}/{scores['chrf']:.1f}"


def _percent(rate: float | None) -> str:
    return "-" if rate is None else f"{100 * rate:.1f}"


def _table(report: dict[str, dict[str, Any]], langs: Sequence[str], title: str, cell) -> str:
    rows = [["", *langs]]
    for src in langs:
        row = [src]
        for tgt in langs:
            r = report.get(f"{src}-{tgt}")
            row.append("" if r is None else cell(r) + ("" if r["supervised"] else ZERO_SHOT_MARK))
        rows.append(row)
    width = max(len(c) for row in rows for c in row)
    return "\n".join([title, *(" ".join(c.rjust(width) for c in row) for row in rows)])


def heatmap(report: dict[str, dict[str, Any]], langs: Sequence[str], path: Path) -> None:
    """BLEU as colours, rows the source, columns the target; zero-shot cells marked `*`, the diagonal (and any
    direction not translated) blank."""
    import numpy as np
    from matplotlib.figure import Figure  # here: a slow import, for the picture alone

    n = len(langs)
    bleu = np.full((n, n), np.nan)
    for i, src in enumerate(langs):
        for j, tgt in enumerate(langs):
            if f"{src}-{tgt}" in report:
                bleu[i, j] = report[f"{src}-{tgt}"]["bleu"]
    size = 1.0 + 0.9 * n
    fig = Figure(figsize=(size + 1.2, size), dpi=100, layout="constrained")  # no pyplot: no backend, no global state
    ax = fig.subplots()
    top = max(1.0, float(np.nanmax(bleu))) if np.isfinite(bleu).any() else 1.0
    image = ax.imshow(np.ma.masked_invalid(bleu), cmap="viridis", vmin=0, vmax=top)
    fig.colorbar(image, ax=ax, label="BLEU")
    ax.set_xticks(range(n), langs)
    ax.set_yticks(range(n), langs)
    ax.set_xlabel("target")
    ax.set_ylabel("source")
    ax.set_title(f"BLEU ({ZERO_SHOT_MARK} zero-shot)")
    for (i, src), (j, tgt) in itertools.product(enumerate(langs), enumerate(langs)):
        r = report.get(f"{src}-{tgt}")
        if r is not None:
            mark = "" if r["supervised"] else ZERO_SHOT_MARK
            ax.text(j, i, f"{r['bleu']:.1f}{mark}", ha="center", va="center", color="w", fontsize=8)
    fig.savefig(path, format="png")
