"""Many languages in one model: the directions a run trains (`data.directions`), the language tokens and where they
go (`model.lang_token`), and the temperature that samples the directions (`data.temperature`). Every other module
asks this one.

Directions: `src-tgt` names of a multi-way text folder's languages (`{split}.{lang}`, line i the same sentence in
every language), or the shorthands `all` (every ordered pair of the folder's languages that have the training split)
and `LANG-centric` (to and from LANG). `expand_config` writes the explicit tuple into the config before anything is
saved, so a saved config always holds it and a restart must match it.

Language tokens: one id per language of the run, after the SentencePiece pieces (as NLLB lays out its codes): the
tokenizer is trained with model.vocab_size - (number of languages) pieces, and language i (in sorted order) is
id vocab_size - L + i. Text never produces them and detokenising drops them; a language is named by its file suffix
or by its code `>>xx<<` (as Marian spells it). Where the ids go (`Placement`), by model.lang_token:
- `none`: nowhere (bilingual models);
- `source`: the target language's token starts the source (Johnson et al. 2017);
- `target`: the target language's token is the decoder's first token after the start (mBART, M2M-100): the loss
  predicts it, decoding forces it;
- `source_and_target`: as `target`, and the source language's own token starts the source (NLLB-200, M2M-100).
They are inserted when batches are assembled, never into the text or the tokenized store; the length filter counts
them.

Temperature: direction d is drawn with probability proportional to w_d * n_d^(1/T), n_d its pairs before the length
filter and w_d its corpus weight (1 for the directions of data.directions): T = 1 samples in proportion to the data,
T -> infinity uniformly (Arivazhagan et al. 2019 use T = 5). The tokenizer's training sample is balanced across
language sides the same way.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import ml_collections
import numpy as np

from transformer_jax.config.schema import LANG_TOKENS as SCHEMES
from transformer_jax.data import sources
from transformer_jax.errors import ConfigError, DataError

ALL = "all"
CENTRIC = "-centric"


@dataclasses.dataclass(frozen=True, order=True)
class Direction:
    src: str
    tgt: str

    @property
    def name(self) -> str:
        return f"{self.src}-{self.tgt}"

    @classmethod
    def parse(cls, entry: str) -> Direction:
        src, dash, tgt = entry.partition("-")
        if not dash or not src or not tgt or "-" in tgt or src == tgt:
            raise ConfigError(
                f"data.directions: {entry!r} is not SRC-TGT (two different language suffixes of data.text_dir), "
                f"{ALL!r} or LANG{CENTRIC}"
            )
        return cls(src, tgt)


def folder_languages(directory: str | Path, split: str) -> list[str]:
    """The languages of a multi-way folder that have `split` ({split}.{lang} files), sorted."""
    directory = Path(directory).expanduser()
    if not directory.is_dir():
        raise DataError(f"text data directory {directory} does not exist (data.text_dir)")
    return sorted(f.name[len(split) + 1 :] for f in directory.glob(f"{split}.*") if f.is_file())


def expand(entries: Sequence[str], available: Sequence[str], where: str) -> tuple[str, ...]:
    """The explicit SRC-TGT names of `entries` (shorthands expanded against the `available` languages, each name
    once, in order); ConfigError for a language that `where` (the folder) lacks."""
    out: list[str] = []
    for entry in entries:
        if entry == ALL:
            names = [f"{s}-{t}" for s in available for t in available if s != t]
        elif entry.endswith(CENTRIC):
            hub = entry[: -len(CENTRIC)]
            if hub not in available:
                raise ConfigError(
                    f"data.directions: {entry!r}: {where} has no language {hub!r}; it has {list(available)}"
                )
            names = [n for other in available if other != hub for n in (f"{hub}-{other}", f"{other}-{hub}")]
        else:
            d = Direction.parse(entry)
            for lang in (d.src, d.tgt):
                if lang not in available:
                    raise ConfigError(
                        f"data.directions: {entry!r}: {where} has no language {lang!r}; it has {list(available)}"
                    )
            names = [d.name]
        out += [n for n in names if n not in out]
    if not out:
        raise ConfigError(f"data.directions: {list(entries)} gives no direction: {where} has {list(available)}")
    return tuple(out)


def expand_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The config with data.directions explicit (unchanged when it is empty or explicit already), checked against
    the folder, and data.direction_lines against the directions."""
    entries = tuple(config.data.directions)
    if entries:
        available = folder_languages(config.data.text_dir, config.data.train_split)
        expanded = expand(entries, available, config.data.text_dir)
        if expanded != entries:
            config = ml_collections.ConfigDict(config.to_dict())
            config.data.directions = expanded
    line_limits(config.data)
    return config


def line_limits(data: ml_collections.ConfigDict) -> dict[str, int]:
    """data.direction_lines by direction name: a direction trained on its first lines only (ConfigError for one that
    is not among data.directions)."""
    limits = {name: int(lines) for name, lines in data.direction_lines}
    unknown = sorted(set(limits) - set(data.directions))
    if unknown:
        raise ConfigError(
            f"data.direction_lines names {unknown}, which data.directions {list(data.directions)} does not train"
        )
    return limits


def language_lines(data: ml_collections.ConfigDict, lang: str, lines: int) -> int:
    """How many of a language file's first `lines` lines some direction trains on (all, unless every direction
    with that language is limited by data.direction_lines): what the tokenizer's sample draws from."""
    limits = line_limits(data)
    used = [limits.get(d.name, lines) for d in directions(data) if lang in (d.src, d.tgt)]
    return min(lines, max(used, default=lines))


def directions(data: ml_collections.ConfigDict) -> list[Direction]:
    """The run's directions (`data` is the data group; explicit, as expand_config leaves it); empty: bilingual."""
    return [Direction.parse(entry) for entry in data.directions]


def languages(data: ml_collections.ConfigDict) -> list[str]:
    """Every language of the run's directions, sorted: the order of their token ids."""
    return sorted({lang for d in directions(data) for lang in (d.src, d.tgt)})


def code(lang: str) -> str:
    """A language's token as text: `>>xx<<`, Marian's spelling (data.target_lang's)."""
    return f">>{lang}<<"


@dataclasses.dataclass(frozen=True)
class Placement:
    """The run's language tokens: `ids[lang]`, and where `scheme` puts them (one source for batching, decoding and
    validation)."""

    scheme: str
    ids: dict[str, int]

    @classmethod
    def of(cls, config: ml_collections.ConfigDict) -> Placement:
        """From a full config: the languages of data.directions take the last ids of model.vocab_size."""
        langs = languages(config.data)
        scheme = config.model.get("lang_token", "none")
        if scheme not in SCHEMES:
            raise ConfigError(f"model.lang_token: unknown value {scheme!r}; choose one of {list(SCHEMES)}")
        if scheme != "none" and not langs:
            raise ConfigError(f"model.lang_token={scheme!r} needs data.directions (the languages to make tokens for)")
        first = config.model.vocab_size - len(langs)
        return cls(scheme, {lang: first + i for i, lang in enumerate(langs)})

    @property
    def first_id(self) -> int | None:
        return min(self.ids.values()) if self.ids else None

    def id(self, lang: str) -> int:
        """The token id of a language named by its suffix or its code >>xx<<."""
        name = lang[2:-2] if lang.startswith(">>") and lang.endswith("<<") else lang
        if name not in self.ids:
            raise ConfigError(f"language {lang!r}: the model has tokens for {sorted(self.ids)}")
        return self.ids[name]

    def source_prefix(self, d: Direction) -> int | None:
        """The id that starts direction d's sources, or None."""
        if self.scheme == "source":
            return self.ids[d.tgt]
        if self.scheme == "source_and_target":
            return self.ids[d.src]
        return None

    def target_prefix(self, d: Direction) -> int | None:
        """The id the decoder predicts first (after BOS) for direction d, or None."""
        return self.ids[d.tgt] if self.scheme in ("target", "source_and_target") else None


def probabilities(sizes: Sequence[int], temperature: float, weights: Sequence[float] | None = None) -> np.ndarray:
    """Each part's share of the draws: w_i * n_i^(1/T), normalised."""
    if temperature <= 0:
        raise ConfigError(f"data.temperature must be > 0, got {temperature}")
    n = np.asarray(sizes, np.float64)
    w = np.ones_like(n) if weights is None else np.asarray(weights, np.float64)
    scores = w * n ** (1.0 / temperature)
    return scores / scores.sum()


def multiway_sides(directory: str | os.PathLike, split: str, langs: Sequence[str]) -> dict[str, Path]:
    """The files `{split}.{lang}` of a multi-way folder (line i the same sentence in every language), one per
    language, after checking that each exists and that all have one line count (DataError naming two files that
    differ)."""
    directory = sources.resolve_path(directory)
    if not directory.is_dir():
        raise DataError(f"text data directory {directory} does not exist (data.text_dir)")
    paths = {lang: directory / f"{split}.{lang}" for lang in langs}
    for lang, path in paths.items():
        if not path.is_file():
            raise DataError(f"data.directions: no file {path} (split {split!r}, language {lang!r})")
    counts = {lang: sources.count_lines(path) for lang, path in paths.items()}
    first = next(iter(paths))
    for lang, n in counts.items():
        if n != counts[first]:
            raise DataError(
                f"line counts differ: {paths[first]} has {counts[first]} lines, {paths[lang]} has {n}; in a "
                "multi-way folder line i of every file must be the same sentence"
            )
    return paths


def validation_directions(
    config: ml_collections.ConfigDict, split: str | None = None
) -> list[tuple[Direction, list[tuple[str, str]]]]:
    """A multilingual run's validation sets (`config` the full config): each direction of data.directions with the
    pairs of `split` (default data.valid_split), line-aligned lines of {split}.{src} and {split}.{tgt} of the
    multi-way data.text_dir (every language's file checked for one line count), pairs with an empty side left out.
    (eval.extra_valid is refused with directions by the config's checks: its folders are language pairs.)"""
    data = config.data
    if not data.text_dir:
        raise DataError("data.directions needs data.text_dir: a multi-way folder of {split}.{lang} files")
    split = data.valid_split if split is None else split
    paths = multiway_sides(data.text_dir, split, languages(data))
    out = []
    for d in directions(data):
        files = sources.TextPairs(paths[d.src], paths[d.tgt])
        out.append((d, [pair for _, chunk in files.chunks(1 << 16) for pair in chunk]))
    return out
