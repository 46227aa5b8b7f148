"""Sources of raw (source, target) sentence pairs: local text files, Multi30k fetched on demand, TFDS builders,
and the weighted training corpora of data.corpora.

Every source yields untokenized strings in the direction the config names (`src_lang` -> `tgt_lang`). Small splits
(validation, test) open as a sequence of pairs (`open_split`). A training split of any size opens for streaming
(`open_stream`): text files are read a block at a time and TFDS array_record files a batch of records at a time,
so building the tokenized store (`store`) or drawing the tokenizer's sample never holds the corpus as Python
strings. Bad input raises `DataError` naming the file and line, never a bare traceback; mismatched line counts are
found by counting line breaks, before any sentence is decoded.
"""

from __future__ import annotations

import codecs
import contextlib
import dataclasses
import gzip
import hashlib
import http.client
import itertools
import os
import shutil
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np
from absl import logging

from transformer_jax import runtime
from transformer_jax.errors import DataError
from transformer_jax.runtime import Progress

Pair = tuple[str, str]

# A folder of local corpus copies (multi30k/, tatoeba_deu_eng/, wmt14_ende/, each of {split}.{lang} files) that
# offline machines, CI and the tests name; data.source=multi30k reads its copy there instead of downloading.
DATA_ENV = "TRANSFORMER_JAX_DATA"

MULTI30K_URL = "https://raw.githubusercontent.com/multi30k/dataset/master/data/task1/raw/"
# Upstream Task 1 raw files: (our split name, upstream stem) and their SHA-256 digests, those of the files at
# MULTI30K_URL in the multi30k/dataset repository.
MULTI30K_SPLITS = {"train": "train", "valid": "val", "test": "test_2016_flickr"}
MULTI30K_SHA256 = {
    "train.en.gz": "d79cfa999dd4c51d2cb42499b6796d5a882c3a8a961923c25a898c90f8bbd56f",
    "train.de.gz": "726e39b2fa9eb9ffb6dc763fb35a179f80fae06ffc5d28b6ace5faa883de28a6",
    "val.en.gz": "14f7d25ddd868909a9213e361768460edcacdd6ab9d1e77b92560dc10c10dc28",
    "val.de.gz": "f0cba2f995189cf5770f29a8a9a537a3ad3f51657ad873405082ff6863a5e75a",
    "test_2016_flickr.en.gz": "611d361c6334bc7246101d48097c13cf5c4413c5befc793cc629934359d532d9",
    "test_2016_flickr.de.gz": "9204244e408ccb38d2a55cfcd344df15005fc42a07a6e55ca6c52b6ababb8cc8",
}


def local_data_dir() -> Path | None:
    """The folder of local corpus copies that $TRANSFORMER_JAX_DATA names (DATA_ENV), or None where it is unset."""
    value = os.environ.get(DATA_ENV)
    return Path(value).expanduser() if value else None


def resolve_path(path: str | os.PathLike) -> Path:
    """A path from a config: `~` expanded, a relative one taken from the working directory (never from where the
    repository sits)."""
    return Path(path).expanduser()


# ----------------------------------------------------------------------------------------------------------------
# Local text files: {split}.{lang}, one sentence per line.


READ_BYTES = 1 << 24  # bytes read at a time when streaming a text file
BOM = codecs.BOM_UTF8  # the byte-order mark Windows editors write at the start of UTF-8 files


def leading_bom(data: bytes, name: str, *, scored: bool = False) -> bytes:
    """The one rule for a UTF-8 byte-order mark at the start of a file's `data`.

    A model input (training corpus, evaluation source or prefix) loses it: kept, it would become part of the first
    sentence and change its translation. A file that is only scored (`scored`: references, hypotheses) keeps it,
    as the `sacrebleu` command (2.6.0) reads it, U+FEFF at the start of the first line, with one warning naming
    the file.
    """
    if not data.startswith(BOM):
        return data
    if scored:
        logging.warning(
            "%s starts with a UTF-8 byte-order mark; scored as the sacrebleu command scores it (U+FEFF kept in the "
            "first line): remove the mark to score the first line's text alone",
            name,
        )
        return data
    return data[len(BOM) :]


def count_lines(path: Path) -> int:
    """Lines of a file without decoding it (one pass of `bytes.count`): LF count, plus one for a last line without
    a final LF."""
    lines, last = 0, b"\n"
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                lines += block.count(b"\n")
                last = block[-1:]
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    return lines + (last != b"\n")


def iter_lines(path: Path) -> Iterator[list[str]]:
    """The lines of a UTF-8 file, a block at a time, split on LF only (sentences may hold U+2028 or U+0085), a
    final CR dropped, a leading byte-order mark too (`leading_bom`); invalid UTF-8 is a DataError naming the line."""
    consumed = line_number = 0  # bytes and lines already yielded
    rest, first = b"", True
    try:
        with open(path, "rb") as f:
            while block := f.read(READ_BYTES):
                if first:
                    stripped, first = leading_bom(block, str(path)), False
                    consumed, block = len(block) - len(stripped), stripped
                data = rest + block
                cut = data.rfind(b"\n")
                if cut < 0:
                    rest = data
                    continue
                lines = _decode(path, data[:cut], consumed, line_number).split("\n")
                rest = data[cut + 1 :]
                consumed, line_number = consumed + cut + 1, line_number + len(lines)
                yield [line.removesuffix("\r") for line in lines]
    except OSError as e:
        raise DataError(f"cannot read {path}: {e.strerror or e}") from e
    if rest:  # a last line without a final LF
        yield [_decode(path, rest, consumed, line_number).removesuffix("\r")]


def _decode(path: Path, data: bytes, offset: int, lines_before: int) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = lines_before + data.count(b"\n", 0, e.start) + 1
        raise DataError(f"{path}, line {line}: invalid UTF-8 ({e.reason} at byte {offset + e.start})") from e


def _available(directory: Path) -> dict[str, list[str]]:
    """Languages -> splits present in a {split}.{lang} directory."""
    found: dict[str, list[str]] = {}
    for f in sorted(directory.iterdir()):
        split, dot, lang = f.name.rpartition(".")
        if dot and split and f.is_file():
            found.setdefault(lang, []).append(split)
    return found


class TextPairs:
    """Two non-empty text files opened for streaming, line i of one the translation of line i of the other; their
    line counts are compared (counted, not decoded) before the first pair is read. `about` prefixes the errors
    about a missing file (the config key that named it)."""

    def __init__(self, src_path: str | os.PathLike, tgt_path: str | os.PathLike, about: str = ""):
        self.src_path, self.tgt_path = resolve_path(src_path), resolve_path(tgt_path)
        for path in (self.src_path, self.tgt_path):
            if not path.is_file():
                raise DataError(f"{about}: no file {path}")
            if not path.stat().st_size:
                raise DataError(f"{about}: {path} is empty" if about else f"{path} is empty")
        self._lines: int | None = None

    def __len__(self) -> int:
        """Lines per side, blank ones included. Counted on first use (a pass over both files, nothing decoded);
        sides with different counts are an error."""
        if self._lines is None:
            src_lines, tgt_lines = count_lines(self.src_path), count_lines(self.tgt_path)
            if src_lines != tgt_lines:
                raise DataError(
                    f"line counts differ: {self.src_path} has {src_lines} lines, {self.tgt_path} has {tgt_lines}; "
                    "line i of one side must be the translation of line i of the other"
                )
            self._lines = src_lines
        return self._lines

    def identity(self) -> dict[str, Any]:
        """What was read, for a store's manifest: the two files with their sizes and modification times."""
        return {
            "files": [
                {"path": str(p.resolve()), "bytes": p.stat().st_size, "mtime_ns": p.stat().st_mtime_ns}
                for p in (self.src_path, self.tgt_path)
            ]
        }

    def _line_chunks(self, size: int) -> Iterator[tuple[list[str], list[str]]]:
        src = itertools.chain.from_iterable(iter_lines(self.src_path))
        tgt = itertools.chain.from_iterable(iter_lines(self.tgt_path))
        while True:
            src_lines, tgt_lines = list(itertools.islice(src, size)), list(itertools.islice(tgt, size))
            if len(src_lines) != len(tgt_lines):  # counted equal when opened: a file changed while being read
                raise DataError(f"{self.src_path} and {self.tgt_path} changed while being read; run again")
            if not src_lines:
                return
            yield src_lines, tgt_lines

    def chunks(self, size: int, *, keep_blank: bool = False) -> Iterator[tuple[int, list[Pair]]]:
        """(lines read, pairs) for every `size` lines, in file order; a pair with an empty side is skipped, counted
        and logged unless `keep_blank`. A split without a single pair is an error."""
        kept, lines = 0, len(self)  # counts both sides first: a mismatch fails before any decoding
        for src_lines, tgt_lines in self._line_chunks(size):
            pairs = list(zip(src_lines, tgt_lines, strict=True))
            if not keep_blank:
                pairs = [(s, t) for s, t in pairs if s.strip() and t.strip()]
            kept += len(pairs)
            yield len(src_lines), pairs
        if kept < lines:
            logging.warning(
                "%s and %s: skipped %d pairs with an empty side", self.src_path, self.tgt_path, lines - kept
            )
        if not kept:
            raise DataError(f"{self.src_path} and {self.tgt_path} hold no pair with both sides non-empty")

    def pick(self, indices: Sequence[int]) -> list[Pair]:
        """The pairs at sorted line `indices`, read in one streaming pass (blank pairs left out)."""
        wanted = np.asarray(indices, np.int64)
        out: list[Pair] = []
        first = 0
        with Progress(len(self), "sampling lines", "lines") as bar:
            for src_lines, tgt_lines in self._line_chunks(1 << 16):
                lo, hi = np.searchsorted(wanted, [first, first + len(src_lines)])
                for i in (wanted[lo:hi] - first).tolist():
                    if src_lines[i].strip() and tgt_lines[i].strip():
                        out.append((src_lines[i], tgt_lines[i]))
                first += len(src_lines)
                bar.update(len(src_lines))
                if hi == len(wanted):
                    break
        return out


def text_split(directory: str | os.PathLike, split: str, src_lang: str, tgt_lang: str) -> TextPairs:
    """`{split}.{src_lang}` and `{split}.{tgt_lang}` of a directory, opened for streaming (`TextPairs`)."""
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
    paths = [directory / f"{split}.{lang}" for lang in (src_lang, tgt_lang)]
    for path, lang in zip(paths, (src_lang, tgt_lang), strict=True):
        if not path.is_file():
            raise DataError(f"missing split {split!r}: no file {path}; available splits for {lang}: {available[lang]}")
    return TextPairs(*paths)


def read_text_split(
    directory: str | os.PathLike, split: str, src_lang: str, tgt_lang: str, *, keep_blank: bool = False
) -> tuple[list[Pair], int]:
    """`{split}.{src_lang}` and `{split}.{tgt_lang}` read whole as aligned pairs, and how many were skipped:
    pairs with an empty side, unless `keep_blank` (evaluation: one hypothesis per source line)."""
    files = text_split(directory, split, src_lang, tgt_lang)
    pairs = [pair for _, chunk in files.chunks(1 << 16, keep_blank=keep_blank) for pair in chunk]
    return pairs, len(files) - len(pairs)


# ----------------------------------------------------------------------------------------------------------------
# Checksummed downloads into a cache directory: a file appears under its final name only complete and verified
# (hashed while streamed into a temporary file beside it, then renamed), so a later run finds it or downloads again.

CHUNK_BYTES = 1 << 16


@contextlib.contextmanager
def atomic_write(dest: Path):
    """Yields a temporary path next to `dest`; renames it onto `dest` only if the block finishes without error."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        os.replace(tmp, dest)
    finally:
        tmp.unlink(missing_ok=True)


def download(url: str, dest: Path, sha256: str, *, timeout: float = 60.0) -> Path:
    """Downloads `url` to `dest` unless `dest` exists; the file appears only once its SHA-256 equals `sha256`."""
    dest = Path(dest)
    if dest.exists():
        return dest
    logging.info("downloading %s to %s", url, dest)
    with atomic_write(dest) as tmp:
        digest = hashlib.sha256()
        received = 0
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response, open(tmp, "wb") as f:
                expected = response.headers.get("Content-Length")
                while chunk := response.read(CHUNK_BYTES):
                    f.write(chunk)
                    digest.update(chunk)
                    received += len(chunk)
        except (http.client.IncompleteRead, ConnectionError) as e:
            raise DataError(f"download of {url} was interrupted after {received} bytes ({e}); nothing was kept") from e
        except urllib.error.HTTPError as e:
            raise DataError(f"download of {url} failed: HTTP {e.code} {e.reason}") from e
        except (urllib.error.URLError, TimeoutError, OSError) as e:
            raise DataError(
                f"cannot download {url}: {getattr(e, 'reason', e)}. Without internet access, put the files in place "
                "by hand or point the config at local files (data.source=text, data.text_dir=...)"
            ) from e
        # A server that closes early without an error still sent fewer bytes than it announced.
        if expected is not None and received != int(expected):
            raise DataError(f"download of {url} was interrupted after {received} of {expected} bytes; nothing was kept")
        if digest.hexdigest() != sha256:
            raise DataError(
                f"checksum mismatch for {dest.name} from {url}: expected sha256 {sha256}, got {digest.hexdigest()}; "
                "the file was not kept (a changed upstream file or a corrupted transfer)"
            )
    return dest


def gunzip(src: Path, dest: Path) -> Path:
    """Decompresses the gzip file `src` into `dest` atomically; returns `dest`."""
    with atomic_write(dest) as tmp:
        try:
            with gzip.open(src, "rb") as fin, open(tmp, "wb") as fout:
                shutil.copyfileobj(fin, fout, CHUNK_BYTES)
        except (OSError, EOFError) as e:
            raise DataError(f"cannot decompress {src}: {e}") from e
    return dest


# ----------------------------------------------------------------------------------------------------------------
# Multi30k: the local copy under $TRANSFORMER_JAX_DATA when complete, else downloaded and verified into the cache.


def fetch_multi30k(cache: str | os.PathLike, *, base_url: str = MULTI30K_URL, timeout: float = 60.0) -> Path:
    """Downloads, verifies and decompresses the Multi30k Task 1 files into `cache`/multi30k (files already
    there are reused without any request); returns that folder of `{train,valid,test}.{en,de}`."""
    target = Path(cache) / "multi30k"
    for split, stem in MULTI30K_SPLITS.items():
        for lang in ("en", "de"):
            final = target / f"{split}.{lang}"
            if final.exists():
                continue
            name = f"{stem}.{lang}.gz"
            gz = download(base_url + name, target / "raw" / name, MULTI30K_SHA256[name], timeout=timeout)
            gunzip(gz, final)
    return target


def multi30k_dir(config: ml_collections.ConfigDict) -> Path:
    """The folder of Multi30k's {train,valid,test}.{en,de}: the local copy if complete, else the checksummed
    download in the cache (fetched once)."""
    local = local_data_dir()
    if local is not None:
        copy = local / "multi30k"
        if all((copy / f"{split}.{lang}").is_file() for split in MULTI30K_SPLITS for lang in ("en", "de")):
            return copy
    return fetch_multi30k(resolve_path(config.cache_dir) if config.cache_dir else runtime.user_cache_root())


# ----------------------------------------------------------------------------------------------------------------
# TFDS translation builders, read through array_record random access (no TensorFlow needed).


class TfdsPairs(Sequence):
    """Random access to (source, target) strings of a TFDS translation split; `about` names it (for a store's
    manifest and for error messages)."""

    def __init__(self, data_source: Any, src_lang: str, tgt_lang: str, about: dict[str, Any] | None = None):
        self._source = data_source
        self._src, self._tgt = src_lang, tgt_lang
        self._about = about or {}

    def __len__(self) -> int:
        return len(self._source)

    def __getitem__(self, index: int) -> Pair:
        return self.get_many([index])[0]

    def get_many(self, indices: Sequence[int]) -> list[Pair]:
        """Reads many records in one call (array_record batches the reads)."""
        records = self._source.__getitems__(list(indices))
        pairs = []
        for index, record in zip(indices, records, strict=True):
            try:
                pairs.append((_text(record[self._src]), _text(record[self._tgt])))
            except UnicodeDecodeError as e:
                name = self._about.get("tfds_name", "dataset")
                raise DataError(f"TFDS {name}, record {index}: invalid UTF-8 ({e.reason}); prepare it again") from e
        return pairs

    def identity(self) -> dict[str, Any]:
        """What is read, for a store's manifest: the builder, its version and data directory, and the records."""
        return {**self._about, "records": len(self)}

    def chunks(self, size: int) -> Iterator[tuple[int, list[Pair]]]:
        """(records read, pairs) for every `size` records in stored order; empty pairs are kept (the pipeline
        drops and counts them)."""
        for start in range(0, len(self), size):
            pairs = self.get_many(range(start, min(start + size, len(self))))
            yield len(pairs), pairs

    def pick(self, indices: Sequence[int]) -> list[Pair]:
        """The pairs at sorted `indices`, as stored, read in batches."""
        out: list[Pair] = []
        with Progress(len(indices), "sampling records", "records") as bar:
            for start in range(0, len(indices), 4096):
                out.extend(self.get_many(indices[start : start + 4096]))
                bar.update(min(4096, len(indices) - start))
        return out


def _text(value: bytes | str) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else value


def _prepare_command(name: str, data_dir: str | None) -> str:
    where = f", data_dir={data_dir!r}" if data_dir else ""
    return (
        'python -c "import tensorflow_datasets as tfds, tensorflow_datasets.translate; '
        f"tfds.builder('{name}'{where}, file_format='array_record').download_and_prepare()\""
    )


def open_tfds_split(config: ml_collections.ConfigDict, name: str, split: str) -> TfdsPairs:
    """Opens split `split` of the TFDS translation builder `name` in the direction of `config` (the data group);
    prepares it first if data.tfds_download and it is missing."""
    import tensorflow_datasets as tfds  # only data.source=tfds needs it, and importing it takes seconds
    import tensorflow_datasets.translate  # registers wmt*_translate, which TFDS otherwise imports lazily

    src_lang, tgt_lang, download = config.src_lang, config.tgt_lang, config.tfds_download
    data_dir = str(resolve_path(config.tfds_data_dir)) if config.tfds_data_dir else None
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
    about = {"tfds_name": name, "version": str(builder.info.version), "data_dir": str(builder.data_dir), "split": split}
    return TfdsPairs(builder.as_data_source(split=split), src_lang, tgt_lang, about)


# ----------------------------------------------------------------------------------------------------------------
# The entry points the pipeline and the training code use.


def open_split(config: ml_collections.ConfigDict, split: str, *, keep_blank: bool = False) -> Sequence[Pair]:
    """`split` of the configured source as a sequence of (source, target) strings: text read whole, without empty
    pairs (skipped and logged) unless `keep_blank`; TFDS read lazily as stored (the pipeline drops empty pairs)."""
    stream = open_stream(config, split)
    if isinstance(stream, TfdsPairs):
        return stream  # read lazily
    return [pair for _, chunk in stream.chunks(1 << 16, keep_blank=keep_blank) for pair in chunk]


def open_stream(config: ml_collections.ConfigDict, split: str) -> TextPairs | TfdsPairs:
    """`split` of the configured source, opened for streaming: `len()` lines or records, `chunks(size)` of
    pairs in stored order, `pick(sorted indices)`, `identity()` (what is read). Nothing is read yet; text files'
    lines are counted on the first `len()`, so mismatched sides fail before any sentence is decoded.
    """
    if config.source == "multi30k":  # fetched if needed
        return text_split(multi30k_dir(config), split, config.src_lang, config.tgt_lang)
    if config.source == "text" and not config.text_dir:
        raise DataError(
            "data.source=text needs data.text_dir: a directory of {split}.{lang} files (or use data.source=multi30k)"
        )
    if config.source == "text":
        return text_split(config.text_dir, split, config.src_lang, config.tgt_lang)
    if config.source == "tfds":
        return open_tfds_split(config, config.tfds_name, split)
    raise DataError(f"unknown data.source {config.source!r}; choose text, multi30k or tfds")


def read_all(pairs: Sequence[Pair]) -> list[Pair]:
    """Materialises `pairs`, reading TFDS records in batches."""
    if isinstance(pairs, TfdsPairs):
        return [pair for _, chunk in pairs.chunks(4096) for pair in chunk]
    return list(pairs)


def load_split(config: ml_collections.ConfigDict, split: str) -> list[Pair]:
    """All (source, target) pairs of `split`, in stored order, without pairs that have an empty side."""
    pairs = read_all(open_split(config, split))
    kept = [(s, t) for s, t in pairs if s.strip() and t.strip()]
    if len(kept) != len(pairs):
        logging.warning("split %s: skipped %d pairs with an empty side", split, len(pairs) - len(kept))
    return kept


# ----------------------------------------------------------------------------------------------------------------
# The training corpora of data.corpora (empty: the single corpus of data.source). A `files` corpus is
# translate_corpus's input and output (or the reverse, for back-translation); a tag (e.g. `<BT>`, Caswell et al.
# 2019) is one piece of the tokenizer (`tokenizer.check_tags`).


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One entry of data.corpora, checked by the key's rule (config/schema.py)."""

    name: str
    kind: str  # text (read as data.source=text reads data.train_split), tfds (with data.tfds_*) or files
    where: str  # the {split}.{lang} directory, the TFDS builder, or SRC_FILE+TGT_FILE
    weight: float  # > 0: the probability of the next training pair is weight / sum of weights (`batching.Mix`)
    tag: str  # written before every non-empty source sentence (`tagged`); empty = none


def corpora(config: ml_collections.ConfigDict) -> list[Corpus]:
    """The corpora of data.corpora (`config` is the data group); empty when the single data.source is used."""
    return [Corpus(name, kind, where, float(weight), tag) for name, kind, where, weight, tag in config.corpora]


def tagged(pairs: Sequence[Pair], tag: str) -> list[Pair]:
    """`pairs` with `tag` and a space before every non-empty source; empty sources stay empty, so the pipeline's
    length filter still drops them."""
    return [(f"{tag} {s}" if tag and s.strip() else s, t) for s, t in pairs]


def open_corpus(config: ml_collections.ConfigDict, corpus: Corpus) -> TextPairs | TfdsPairs:
    """`corpus` opened for streaming (its tag not applied: `tagged`); a missing or empty corpus is one DataError
    naming it."""
    about = f"data.corpora: corpus {corpus.name!r}"
    if corpus.kind == "text":
        directory = resolve_path(corpus.where)
        if not directory.is_dir():
            raise DataError(f"{about}: the directory {directory} does not exist")
        stream = text_split(directory, config.train_split, config.src_lang, config.tgt_lang)
    elif corpus.kind == "files":
        stream = TextPairs(*corpus.where.split("+"), about)
    else:
        stream = open_tfds_split(config, corpus.where, config.train_split)
    if not len(stream):  # text: both sides' lines counted here, so unequal sides fail before anything is decoded
        raise DataError(f"{about} ({corpus.where}) has no pairs")
    return stream


def validation_sets(config: ml_collections.ConfigDict) -> list[tuple[str, list[tuple[str, str]]]]:
    """(name, pairs) of every validation set: data.valid_split first (name ""), then each eval.extra_valid set
    (text files {split}.{lang} in its directory, the run's languages)."""
    sets = [("", load_split(config.data, config.data.valid_split))]
    for name, directory, split in config.eval.extra_valid:
        source = ml_collections.ConfigDict(config.data.to_dict())
        source.source, source.text_dir = "text", directory
        sets.append((name, load_split(source, split)))
    return sets
