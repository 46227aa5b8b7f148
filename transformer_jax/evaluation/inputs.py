"""The sentences an evaluation run reads: a UTF-8 file, a split of the configured data, or stdin line by line.

Every line is kept, blank ones too: evaluation gives one hypothesis per source line. A byte-order mark at the start
of a file (or of stdin) is dropped, as from every model input (`sources.leading_bom`).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator

from transformer_jax.data import sources
from transformer_jax.errors import EvalError
from transformer_jax.evaluation import bleu


def read_sources(path: str) -> list[str]:
    """Lines of a UTF-8 file split at LF only, each with its line ending removed (nothing else); a leading
    byte-order mark is dropped (`sources.leading_bom`): it is no part of the first sentence."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e.strerror or e}") from e
    return [line.rstrip("\r") for line in bleu.decode_lines(data, path, EvalError)]


def split_pairs(config, split: str) -> tuple[list[str], list[str], str]:
    """Every line of the split, blank ones included: evaluation gives one hypothesis per source line."""
    name = config.data.valid_split if split == "valid" else config.data.test_split
    pairs = sources.read_all(sources.open_split(config.data, name, keep_blank=True))
    if not pairs:
        raise EvalError(f"split {name!r} of data.source={config.data.source} has no lines: nothing to translate")
    return [s for s, _ in pairs], [t for _, t in pairs], name


def split_files(config, split_name: str) -> dict[str, str]:
    """The files a text split is read from (for the output-is-not-an-input check); none for other sources."""
    if config.data.source != "text":
        return {}
    directory = sources.resolve_path(config.data.text_dir)
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
            [line] = bleu.decode_lines(raw, "stdin", EvalError, first_line=number)
        except EvalError as e:
            raise EvalError(f"{e}; the {number - 1} lines before it were translated") from None
        yield line.rstrip("\r")
