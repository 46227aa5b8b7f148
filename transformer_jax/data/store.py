"""The training split tokenized once into memory-mapped files: every later start, on every host, opens it in
about a second, reads no text and tokenizes nothing.

What is stored: the four arrays of `batching.Examples` for every pair of the split, exactly what the in-memory path
(`pipeline.make_train_iterator` without `examples`) tokenizes, as .npy files opened with `np.load(mmap_mode="r")`;
everything after tokenization is the same code on the same values, so the batches are the in-memory path's. The
length filter (data.max_len) runs when a run starts, not at build time: example ids, which a checkpoint's iterator
state holds, stay the in-memory path's (a run resumes exactly across the switch), and runs that differ only in
max_len share one store.

Why memory-mapped .npy: no load time and no private memory; the OS pages in the offsets (read whole, to plan
batches from the lengths) and the token pages of the batches being assembled, shared between a host's processes.
Each .npy describes its own dtype and length; array_record would need every record parsed for the lengths that
the offsets give with one np.diff. Tokens are uint16 on disk when the vocabulary fits (half of int32); assembly
copies them into the int32 batch arrays, so batches do not change.

Checksums: the SHA-256 of each file's data is kept in the manifest, and `verify` rereads every byte (`prepare
--verify`; minutes for tens of GB). A start checks what is cheap: sizes, dtypes and lengths against the manifest,
the SHA-256 of 64 blocks of 4 KiB spread over each file, and that the offsets increase from 0 to the token count.
That finds a truncated, replaced or partly overwritten file and damaged offsets in well under a second at any size;
a flipped bit inside a token array between the sampled blocks is left to `verify`.

Where: next to the tokenizer (or in data.store_dir), named after the tokenizer, split and direction, e.g.
`spm.train.en-de.store/`, on a filesystem every host sees. A missing store, or one built from other input (the
manifest's `identity`), is built by a single-host run and refused, with the prepare command, by a multi-host one.
A build writes into a temporary directory renamed into place when complete, so a failure leaves no store behind.
With data.corpora, one store per corpus, `spm.corpus-NAME.train.en-de.store` (its identity adds the corpus's kind
and tag); `open_train_examples` opens them all as one `MixedExamples`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ml_collections
import numpy as np

from transformer_jax import runtime
from transformer_jax.data import batching, sources
from transformer_jax.data.tokenizer import Tokenizer
from transformer_jax.errors import DataError, DiskFullError
from transformer_jax.runtime import Progress

log = logging.getLogger(__name__)  # the standard logger, which train.py shows at INFO (it quiets absl's)

FORMAT = 1  # bump when the layout changes: older stores then count as built from other input and are rebuilt
MANIFEST = "manifest.json"
ARRAYS = ("src", "src_starts", "tgt", "tgt_starts")  # the fields of batching.Examples, one .npy file each
SIDE_ARRAYS = ("tokens", "starts")  # one language side of a multi-way folder
HEADER_BYTES = 128  # the .npy v1.0 header of any 1-D array of these dtypes (numpy pads headers to 64 bytes)
CHUNK_PAIRS = 100_000  # pairs read and tokenized at a time (bounds the Python strings and id lists held)
SAMPLE_BLOCKS, SAMPLE_BYTES = 64, 4096  # what a start hashes of each file


def store_path(config: ml_collections.ConfigDict, tokenizer: Tokenizer, corpus: sources.Corpus | None = None) -> Path:
    """Where the store of `config.train_split` (of `corpus`, one of data.corpora) lives: data.store_dir, else the
    tokenizer's directory."""
    directory = Path(config.store_dir).expanduser() if config.store_dir else tokenizer.path.parent
    name = f"{tokenizer.name}." + (f"corpus-{corpus.name}." if corpus else "")
    return directory / f"{name}{config.train_split}.{config.src_lang}-{config.tgt_lang}.store"


def open_input(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, corpus: sources.Corpus | None = None
) -> tuple[sources.TextPairs | sources.TfdsPairs, dict[str, Any]]:
    """The training split (of `corpus`) opened for streaming, and what a store of it depends on (its identity: a
    store whose manifest records another is stale)."""
    if corpus is None:
        stream = sources.open_stream(config, config.train_split)
        source, read = config.source, stream.identity()
    else:
        stream = sources.open_corpus(config, corpus)
        source, read = f"corpus:{corpus.kind}", {**stream.identity(), "tag": corpus.tag}
    return stream, {
        "format": FORMAT,
        "source": source,
        "input": read,
        "split": config.train_split,
        "src_lang": config.src_lang,
        "tgt_lang": config.tgt_lang,
        "tokenizer_sha256": tokenizer.fingerprint(),  # the files' contents: another tokenizer's store is never reused
        "token_dtype": _token_dtype(tokenizer).str,
    }


def _token_dtype(tokenizer: Tokenizer) -> np.dtype:
    return np.dtype("<u2") if tokenizer.vocab_size <= 1 << 16 else np.dtype("<i4")


# ----------------------------------------------------------------------------------------------------------------
# Building.


class _NpyWriter:
    """A 1-D .npy file written by appending: the data first, after room for the header, then the header."""

    def __init__(self, path: Path, dtype: np.dtype):
        self.path, self.dtype, self.length = path, dtype, 0
        self._file = open(path, "wb")  # closed by close(); the build's cleanup removes it on error
        self._file.write(b"\0" * HEADER_BYTES)
        self._digest = hashlib.sha256()

    def append(self, array: np.ndarray) -> None:
        data = np.ascontiguousarray(array, self.dtype)
        self._file.write(data.data)
        self._digest.update(data.data)
        self.length += len(data)

    def close(self) -> dict[str, Any]:
        self._file.seek(0)
        header = {"descr": self.dtype.str, "fortran_order": False, "shape": (self.length,)}
        np.lib.format.write_array_header_1_0(self._file, header)
        if self._file.tell() != HEADER_BYTES:
            raise AssertionError(f"an .npy header of {self._file.tell()} bytes, not {HEADER_BYTES}; this is a bug")
        self._file.close()
        size = self.path.stat().st_size
        return {
            "dtype": self.dtype.str,
            "length": self.length,
            "bytes": size,
            "data_sha256": self._digest.hexdigest(),
            "sample_sha256": _sample_sha256(self.path, size),
        }


def _sample_sha256(path: Path, size: int) -> str:
    """SHA-256 of SAMPLE_BLOCKS blocks spread evenly over the file (the last one ending at its end)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for offset in np.linspace(0, max(size - SAMPLE_BYTES, 0), SAMPLE_BLOCKS).astype(np.int64).tolist():
            f.seek(offset)
            digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def build(
    config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    path: Path,
    *,
    num_threads: int,
    chunk_pairs: int = CHUNK_PAIRS,
    corpus: sources.Corpus | None = None,
) -> dict[str, Any]:
    """Streams, tokenizes and writes the training split into a new store at `path`; returns its manifest.

    The split is read and encoded `chunk_pairs` pairs at a time and appended to the growing files, so memory does
    not grow with the corpus. Written into a temporary directory renamed onto `path` when complete."""
    start = time.perf_counter()
    stream, expected = open_input(config, tokenizer, corpus)
    total = len(stream)  # text: counts both files' lines, so a mismatch fails before any tokenizing
    with _building(path) as tmp:
        token_dtype, start_dtype = _token_dtype(tokenizer), np.dtype("<i8")
        writers = {
            name: _NpyWriter(tmp / f"{name}.npy", start_dtype if name.endswith("_starts") else token_dtype)
            for name in ARRAYS
        }
        for side in ("src", "tgt"):
            writers[f"{side}_starts"].append(np.zeros(1, np.int64))
        log.info("tokenizing %d lines of split %r into %s", total, config.train_split, path)
        with Progress(total, f"tokenizing {config.train_split}", "lines") as bar:
            for lines, pairs in stream.chunks(chunk_pairs):
                pairs = sources.tagged(pairs, corpus.tag if corpus else "")
                if pairs:
                    part = batching.encode(pairs, tokenizer, num_threads)
                    for side, flat, starts in (("src", part.src, part.src_starts), ("tgt", part.tgt, part.tgt_starts)):
                        writers[f"{side}_starts"].append(starts[1:] + writers[side].length)
                        writers[side].append(flat)
                bar.update(lines)
        files = {name: writer.close() for name, writer in writers.items()}
        manifest = {
            "identity": expected,
            "counts": {
                "lines": total,
                "pairs": files["src_starts"]["length"] - 1,
                "src_tokens": files["src"]["length"],
                "tgt_tokens": files["tgt"]["length"],
            },
            "files": files,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    log.info("built %s in %.0f s: %s", path, manifest["build_seconds"], manifest["counts"])
    return manifest


@contextlib.contextmanager
def _building(path: Path) -> Iterator[Path]:
    """A new temporary directory beside `path`, installed as `path` when the block completes; on any failure it is
    removed (no store is left), and a failed write (disk full, permissions) is one line (`_unwritable`)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".building", dir=path.parent))
    except OSError as e:
        raise _unwritable(path, e) from e
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp's 0o700 would hide the store from the other hosts' users
        _install(tmp, path)
    except OSError as e:  # reading errors are DataErrors already: this is a write (disk full, permissions)
        shutil.rmtree(tmp, ignore_errors=True)
        raise _unwritable(path, e) from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _unwritable(path: Path, error: OSError) -> DataError | DiskFullError:
    """One line for a failed write; the build's temporary directory is already removed, so no store is left."""
    if runtime.is_disk_full(error):
        return DiskFullError(
            f"disk full while building the tokenized training store {path} ({runtime.space_report(path.parent)}); "
            "the unfinished store was removed: free space there, or set data.store_dir to a directory with room "
            "that every host sees"
        )
    return DataError(
        f"cannot write the tokenized training store {path}: {error.strerror or error}; set data.store_dir to a "
        "writable directory every host sees"
    )


def _install(tmp: Path, path: Path) -> None:
    """Renames the finished `tmp` onto `path`, a stale store there moved aside first (a process that has its files
    memory-mapped keeps reading them), then removed."""
    try:
        os.rename(tmp, path)
        return
    except OSError:
        if not path.exists():
            raise
    old = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    os.rename(path, old / path.name)
    os.rename(tmp, path)
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------------
# Opening and checking.


def read_manifest(path: Path, arrays: tuple[str, ...] = ARRAYS) -> dict[str, Any] | None:
    """The store's manifest (a store of `arrays`), or None when there is no store at `path`."""
    file = path / MANIFEST
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text(encoding="utf-8"))
        if (
            not isinstance(manifest, dict)
            or "identity" not in manifest
            or set(manifest.get("files", ())) != set(arrays)
        ):
            raise ValueError("not a store manifest")
    except (OSError, ValueError) as e:
        raise DataError(f"{file} is unreadable ({e}); the store is damaged: delete {path} and start again") from e
    return manifest


def _damaged(file: Path, what: str, path: Path) -> DataError:
    return DataError(
        f"{file}: {what}; the store is damaged (disk fault or a partial copy): delete {path} and start again "
        "to rebuild it, or run `python -m transformer_jax.data.prepare --verify` to check every byte"
    )


def _open_arrays(path: Path, manifest: dict[str, Any], names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The store's arrays `names`, memory-mapped, after the cheap checks of the module docstring; each pair of
    (tokens, starts) arrays is checked to be a ragged array."""
    arrays = {}
    for name in names:
        file, info = path / f"{name}.npy", manifest["files"][name]
        size = file.stat().st_size if file.is_file() else None
        if size != info["bytes"]:
            raise _damaged(file, f"{size} bytes where the manifest says {info['bytes']}", path)
        if _sample_sha256(file, size) != info["sample_sha256"]:
            raise _damaged(file, "fails its checksum (sampled blocks)", path)
        try:
            array = np.load(file, mmap_mode="r")
        except ValueError as e:
            raise _damaged(file, f"not a readable .npy file ({e})", path) from e
        if array.dtype.str != info["dtype"] or array.shape != (info["length"],):
            raise _damaged(
                file, f"holds {array.dtype}{array.shape}, the manifest {info['dtype']}({info['length']},)", path
            )
        arrays[name] = np.asarray(array)  # a plain ndarray view of the map: no np.memmap overhead per indexing
    for tokens_name in names[::2]:
        starts_name = "starts" if tokens_name == "tokens" else f"{tokens_name}_starts"
        starts, tokens = arrays[starts_name], arrays[tokens_name]
        if not (len(starts) and starts[0] == 0 and starts[-1] == len(tokens) and np.all(starts[1:] > starts[:-1])):
            raise _damaged(path / f"{starts_name}.npy", "offsets do not increase from 0 to the token count", path)
    return arrays


def open_examples(path: Path, manifest: dict[str, Any]) -> batching.Examples:
    """The store's examples, memory-mapped."""
    return batching.Examples(**_open_arrays(path, manifest, ARRAYS))


def verify(path: Path, arrays: tuple[str, ...] = ARRAYS) -> dict[str, Any]:
    """Rereads every byte of the store (of `arrays`: SIDE_ARRAYS for a language side) and compares each file's
    SHA-256 with the manifest's; returns it."""
    manifest = read_manifest(path, arrays)
    if manifest is None:
        raise DataError(f"no store at {path} ({MANIFEST} missing)")
    _open_arrays(path, manifest, arrays)
    for name in arrays:
        file, digest = path / f"{name}.npy", hashlib.sha256()
        with open(file, "rb") as f:
            f.seek(HEADER_BYTES)
            while block := f.read(1 << 24):
                digest.update(block)
        if digest.hexdigest() != manifest["files"][name]["data_sha256"]:
            raise _damaged(file, "fails its checksum (SHA-256 of all its data)", path)
    return manifest


def open_train_examples(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, *, build_if_missing: bool, num_threads: int | None = None
) -> tuple[batching.Examples | batching.MixedExamples, list[Path]]:
    """The training examples from their stores (`open_train_store`), and the stores' paths: the split of
    data.source, or every corpus of data.corpora as one `MixedExamples`."""
    mix = sources.corpora(config)
    opened = [
        open_train_store(config, tokenizer, build_if_missing=build_if_missing, num_threads=num_threads, corpus=c)
        for c in mix or [None]
    ]
    paths = [path for _, path in opened]
    if not mix:
        return opened[0][0], paths
    return batching.MixedExamples([e for e, _ in opened], [c.name for c in mix], [c.weight for c in mix]), paths


def open_train_store(
    config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    *,
    build_if_missing: bool,
    num_threads: int | None = None,
    corpus: sources.Corpus | None = None,
) -> tuple[batching.Examples, Path]:
    """The training split's (`corpus`'s) examples from its store, built first if missing or stale, and its path.
    `build_if_missing=False` (multi-host runs: every host must read one store) fails with the prepare command."""
    path = store_path(config, tokenizer, corpus)
    expected = open_input(config, tokenizer, corpus)[1]
    manifest = read_manifest(path)
    if manifest is not None and manifest["identity"] == expected:
        examples = open_examples(path, manifest)
        log.info("training examples from %s: %d pairs (memory-mapped)", path, len(examples))
        return examples, path
    why = "does not exist"
    if manifest is not None:
        found = manifest["identity"]
        differ = sorted(k for k in expected.keys() | found.keys() if found.get(k) != expected.get(k))
        why = f"was built from other input (differs in {', '.join(differ)})"
    if not build_if_missing:
        raise DataError(
            f"the tokenized training store {path} {why}, and this run may not build it (several hosts would each "
            "build their own): `python -m transformer_jax.data.prepare --config <the same config> --workdir <the same "
            f"workdir>` builds {path} once; run it on a filesystem every host sees"
        )
    log.info("the tokenized training store %s %s: building it", path, why)
    manifest = build(config, tokenizer, path, num_threads=num_threads or os.cpu_count() or 1, corpus=corpus)
    return open_examples(path, manifest), path


# ----------------------------------------------------------------------------------------------------------------
# Multilingual runs (data.directions): one store per language side of the multi-way folder, `spm.train.de.side.store`,
# whatever the number of directions that read it. Every line is stored, blank ones as an empty side (EOS only), so
# that line i is example i in every language; a direction's examples are two sides' arrays side by side, and the
# length filter drops a pair with an empty side. Language tokens are never stored (data/languages.py).


def side_path(config: ml_collections.ConfigDict, tokenizer: Tokenizer, lang: str) -> Path:
    directory = Path(config.store_dir).expanduser() if config.store_dir else tokenizer.path.parent
    return directory / f"{tokenizer.name}.{config.train_split}.{lang}.side.store"


def _side_identity(config: ml_collections.ConfigDict, tokenizer: Tokenizer, file: Path, lang: str) -> dict[str, Any]:
    stat = file.stat()
    return {
        "format": FORMAT,
        "source": "multiway",
        "input": {"path": str(file.resolve()), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns},
        "split": config.train_split,
        "lang": lang,
        "tokenizer_sha256": tokenizer.fingerprint(),
        "token_dtype": _token_dtype(tokenizer).str,
    }


def encode_side(lines: list[str], tokenizer: Tokenizer, num_threads: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens, starts) of lines, an EOS after each (a blank line: EOS only)."""
    return batching.ragged(tokenizer.encode_target_batch(lines, num_threads), tokenizer.ids.eos)


def build_side(
    config: ml_collections.ConfigDict, tokenizer: Tokenizer, path: Path, file: Path, lang: str, *, num_threads: int
) -> dict[str, Any]:
    """Tokenizes one language file into a new side store at `path` (streamed, written whole or not at all)."""
    start = time.perf_counter()
    total = sources.count_lines(file)
    with _building(path) as tmp:
        writers = {"tokens": _NpyWriter(tmp / "tokens.npy", _token_dtype(tokenizer))}
        writers["starts"] = _NpyWriter(tmp / "starts.npy", np.dtype("<i8"))
        writers["starts"].append(np.zeros(1, np.int64))
        with Progress(total, f"tokenizing {file.name}", "lines") as bar:
            for lines in sources.iter_lines(file):
                tokens, starts = encode_side(lines, tokenizer, num_threads)
                writers["starts"].append(starts[1:] + writers["tokens"].length)
                writers["tokens"].append(tokens)
                bar.update(len(lines))
        files = {name: writer.close() for name, writer in writers.items()}
        manifest = {
            "identity": _side_identity(config, tokenizer, file, lang),
            "counts": {"lines": files["starts"]["length"] - 1, "tokens": files["tokens"]["length"]},
            "files": files,
            "build_seconds": round(time.perf_counter() - start, 1),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
    log.info("built %s in %.0f s: %s", path, manifest["build_seconds"], manifest["counts"])
    return manifest


def open_sides(
    config: ml_collections.ConfigDict,
    tokenizer: Tokenizer,
    files: dict[str, Path],
    *,
    store: bool,
    build_if_missing: bool,
    num_threads: int | None = None,
) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """(tokens, starts) of each language file (`files`, languages.multiway_sides): from its side store (built first
    if missing or stale; a multi-host run fails with the prepare command instead), or tokenized in memory."""
    threads = num_threads or os.cpu_count() or 1
    out = {}
    for lang, file in files.items():
        if not store:
            out[lang] = encode_side([x for block in sources.iter_lines(file) for x in block], tokenizer, threads)
            continue
        path = side_path(config, tokenizer, lang)
        manifest = read_manifest(path, SIDE_ARRAYS)
        if manifest is None or manifest["identity"] != _side_identity(config, tokenizer, file, lang):
            if not build_if_missing:
                raise DataError(
                    f"the tokenized store {path} is missing or stale, and this run may not build it (several hosts "
                    "would each build their own): `python -m transformer_jax.data.prepare --config <the same config> "
                    f"--workdir <the same workdir>` builds it once"
                )
            manifest = build_side(config, tokenizer, path, file, lang, num_threads=threads)
        arrays = _open_arrays(path, manifest, SIDE_ARRAYS)
        out[lang] = arrays["tokens"], arrays["starts"]
    return out
