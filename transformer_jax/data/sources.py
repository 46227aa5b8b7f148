"""Sources of raw (source, target) sentence pairs: local text files, Multi30k fetched on demand, TFDS builders.

Every source yields untokenized strings in the direction the config names (`src_lang` -> `tgt_lang`). A split
opens as a random-access sequence of pairs, so the tokenizer can sample it and the pipeline can shard it without
reading everything twice. Bad input raises `DataError` naming the file and line, never a bare traceback.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import ml_collections
from absl import logging

from transformer_jax.data import download as download_lib
from transformer_jax.errors import DataError

Pair = tuple[str, str]

REPO_ROOT = Path(__file__).resolve().parents[2]

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
# Upstream Task 1 raw files: (our split name, upstream stem) and their SHA-256 digests
# (from /work/shared/data/README.md, a snapshot of the multi30k/dataset repository).
MULTI30K_SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}


def shared_data_dir() -> Path:
    """The read-only corpora folder next to the repository (`../shared/data`), or $TRANSFORMER_JAX_DATA."""
    return Path(os.environ.get("TRANSFORMER_JAX_DATA") or REPO_ROOT.parent / "shared" / "data")


def resolve_path(path: str | os.PathLike) -> Path:
    """A relative path means the working directory if it exists there, else the repository root.

    Config defaults such as `../shared/data/multi30k` are written relative to the repository root, while paths a
    user types on the command line are relative to where they stand; trying both keeps both working.
    """
    path = Path(path).expanduser()
    if path.is_absolute() or path.exists():
        return path
    return REPO_ROOT / path


def cache_dir(config: ml_collections.ConfigDict) -> Path:
    return resolve_path(config.cache_dir) if config.cache_dir else Path.home() / ".cache" / "transformer_jax"


# ----------------------------------------------------------------------------------------------------------------
# Local text files: {split}.{lang}, one sentence per line.


def _read_lines(path: Path) -> list[str]:
    """The lines of a UTF-8 file, split on LF only (sentences may hold U+2028 or U+0085, which are not breaks)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    if not data:
        raise DataError(f"{path} is empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: invalid UTF-8 ({e.reason} at byte {e.start})") from e
    lines = text.split("\n")
    if lines[-1] == "":  # the final line break ends the last line; it does not start an empty one
        lines.pop()
    return [line.removesuffix("\r") for line in lines]


def _available(directory: Path) -> dict[str, list[str]]:
    """Languages -> splits present in a {split}.{lang} directory."""
    found: dict[str, list[str]] = {}
    for f in sorted(directory.iterdir()):
        split, dot, lang = f.name.rpartition(".")
        if dot and split and f.is_file():
            found.setdefault(lang, []).append(split)
    return found


def read_text_split(
    directory: str | os.PathLike, split: str, src_lang: str, tgt_lang: str, *, keep_blank: bool = False
) -> tuple[list[Pair], int]:
    """Reads `{split}.{src_lang}` and `{split}.{tgt_lang}` as aligned pairs.

    Returns (pairs, skipped): for training, a pair whose either side is empty or only whitespace is skipped and
    counted; `keep_blank` (evaluation: one hypothesis per source line) keeps every line and skips nothing.
    """
    directory = resolve_path(directory)
    if not directory.is_dir():
        raise DataError(f"text data directory {directory} does not exist (data.text_dir)")
    available = _available(directory)
    for lang in (src_lang, tgt_lang):
        if lang not in available:
            raise DataError(
                f"no files for language {lang!r} in {directory} (language pair {src_lang}-{tgt_lang}); "
                f"available languages: {sorted(available)}"
            )
    src_path, tgt_path = directory / f"{split}.{src_lang}", directory / f"{split}.{tgt_lang}"
    for path, lang in ((src_path, src_lang), (tgt_path, tgt_lang)):
        if not path.is_file():
            raise DataError(f"missing split {split!r}: no file {path}; available splits for {lang}: {available[lang]}")
    src_lines, tgt_lines = _read_lines(src_path), _read_lines(tgt_path)
    if len(src_lines) != len(tgt_lines):
        raise DataError(
            f"line counts differ: {src_path} has {len(src_lines)} lines, {tgt_path} has {len(tgt_lines)}; "
            "line i of one side must be the translation of line i of the other"
        )
    pairs = [(s, t) for s, t in zip(src_lines, tgt_lines, strict=True) if keep_blank or (s.strip() and t.strip())]
    skipped = len(src_lines) - len(pairs)
    if skipped:
        logging.warning(
            "%s/%s.{%s,%s}: skipped %d pairs with an empty side", directory, split, src_lang, tgt_lang, skipped
        )
    if not pairs:
        raise DataError(f"{src_path} and {tgt_path} hold no pair with both sides non-empty")
    return pairs, skipped


# ----------------------------------------------------------------------------------------------------------------
# Multi30k: the shared copy when present, else downloaded and verified into the cache.


def fetch_multi30k(cache: str | os.PathLike, *, base_url: str = MULTI30K_URL, timeout: float = 60.0) -> Path:
    """Downloads, verifies and decompresses the Multi30k Task 1 files into `cache`/multi30k; returns that folder.

    Files already there are reused without any request; the folder then holds `{train,valid,test}.{en,de}`.
    """
    target = Path(cache) / "multi30k"
    for split, stem in MULTI30K_SPLITS.items():
        for lang in ("en", "de"):
            final = target / f"{split}.{lang}"
            if final.exists():
                continue
            name = f"{stem}.{lang}.gz"
            gz = download_lib.download(base_url + name, target / "raw" / name, MULTI30K_SHA256[name], timeout=timeout)
            download_lib.gunzip(gz, final)
    return target


def multi30k_dir(config: ml_collections.ConfigDict) -> Path:
    shared = shared_data_dir() / "multi30k"
    if all((shared / f"{split}.{lang}").is_file() for split in MULTI30K_SPLITS for lang in ("en", "de")):
        return shared
    return fetch_multi30k(cache_dir(config))


# ----------------------------------------------------------------------------------------------------------------
# TFDS translation builders, read through array_record random access (no TensorFlow needed).


class TfdsPairs(Sequence):
    """Random access to (source, target) strings of a TFDS translation split."""

    def __init__(self, data_source: Any, src_lang: str, tgt_lang: str):
        self._source = data_source
        self._src, self._tgt = src_lang, tgt_lang

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Pair:
        record = self._source[index]
        return _text(record[self._src]), _text(record[self._tgt])

    def get_many(self, indices: Sequence[int]) -> list[Pair]:
        """Reads many records in one call (array_record batches the reads)."""
        records = self._source.__getitems__(list(indices))
        return [(_text(r[self._src]), _text(r[self._tgt])) for r in records]


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _prepare_command(name: str, data_dir: str | None) -> str:
    where = f", data_dir={data_dir!r}" if data_dir else ""
    return (
        'python -c "import tensorflow_datasets as tfds, tensorflow_datasets.translate; '
        f"tfds.builder('{name}'{where}, file_format='array_record').download_and_prepare()\""
    )


def open_tfds_split(name: str, data_dir: str, split: str, src_lang: str, tgt_lang: str, *, download: bool) -> TfdsPairs:
    """Opens a TFDS translation split; prepares it first if `download` and it is missing."""
    import tensorflow_datasets as tfds
    import tensorflow_datasets.translate  # noqa: F401  (registers wmt*_translate; TFDS imports it lazily otherwise)

    data_dir = str(resolve_path(data_dir)) if data_dir else None
    try:
        builder = tfds.builder(name, data_dir=data_dir, file_format="array_record")
    except (tfds.core.registered.DatasetNotFoundError, ValueError) as e:
        first_line = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(f"unknown TFDS dataset {name!r} (data.tfds_name): {first_line}") from e
    languages = list(getattr(builder.info.features, "languages", None) or [])
    if not languages:
        raise DataError(f"TFDS dataset {name!r} is not a translation dataset (it has no Translation feature)")
    if src_lang not in languages or tgt_lang not in languages or src_lang == tgt_lang:
        raise DataError(
            f"TFDS dataset {name!r} has languages {languages}; it cannot give the pair {src_lang}-{tgt_lang} "
            "(data.src_lang, data.tgt_lang)"
        )
    if not builder.is_prepared():
        where = builder.data_dir
        how = (
            f"prepare it once on a machine with internet access:\n  {_prepare_command(name, data_dir)}\n"
            "or point data.source=text and data.text_dir at a directory of {split}.{lang} files"
        )
        if not download:
            raise DataError(f"TFDS dataset {name!r} is not prepared in {where} (data.tfds_download=False); {how}")
        logging.info("preparing TFDS dataset %s in %s (downloads; needs internet access)", name, where)
        try:
            builder.download_and_prepare()
        except Exception as e:  # TFDS raises many kinds (requests, OSError, ...); all mean "could not prepare"
            raise DataError(f"cannot download and prepare TFDS dataset {name!r} into {where}: {e}\n{how}") from e
    splits = list(builder.info.splits.keys())
    if split not in splits:
        raise DataError(f"TFDS dataset {name!r} has no split {split!r}; available splits: {splits}")
    return TfdsPairs(builder.as_data_source(split=split), src_lang, tgt_lang)


# ----------------------------------------------------------------------------------------------------------------
# The entry points the pipeline and the training code use.


def open_split(config: ml_collections.ConfigDict, split: str, *, keep_blank: bool = False) -> Sequence[Pair]:
    """A random-access sequence of (source, target) strings for `split` of the configured source.

    Text sources come back without empty pairs (skipped and logged) unless `keep_blank` (evaluation keeps every
    line); TFDS splits are read lazily as stored, so the pipeline drops and counts their empty pairs.
    """
    if config.source == "text":
        return read_text_split(config.text_dir, split, config.src_lang, config.tgt_lang, keep_blank=keep_blank)[0]
    if config.source == "multi30k":
        directory = multi30k_dir(config)
        return read_text_split(directory, split, config.src_lang, config.tgt_lang, keep_blank=keep_blank)[0]
    if config.source == "tfds":
        return open_tfds_split(
            config.tfds_name,
            config.tfds_data_dir,
            split,
            config.src_lang,
            config.tgt_lang,
            download=config.tfds_download,
        )
    raise DataError(f"unknown data.source {config.source!r}; choose text, multi30k or tfds")


def read_all(pairs: Sequence[Pair], indices: Sequence[int] | None = None) -> list[Pair]:
    """Materialises `pairs` (or the given indices of it), reading TFDS records in batches."""
    indices = range(len(pairs)) if indices is None else indices
    if isinstance(pairs, TfdsPairs):
        out: list[Pair] = []
        for start in range(0, len(indices), 4096):
            out.extend(pairs.get_many(indices[start : start + 4096]))
        return out
    return [pairs[i] for i in indices]


def load_split(config: ml_collections.ConfigDict, split: str) -> list[Pair]:
    """All (source, target) pairs of `split`, in stored order, without pairs that have an empty side."""
    pairs = read_all(open_split(config, split))
    kept = [(s, t) for s, t in pairs if s.strip() and t.strip()]
    if len(kept) != len(pairs):
        logging.warning("split %s: skipped %d pairs with an empty side", split, len(pairs) - len(kept))
    return kept
