"""The training corpora of data.corpora: several parallel corpora, each with a weight and an optional tag.

`NAME=KIND:WHERE:WEIGHT[:TAG],...` (parsed once, by `config.checks.corpus_specs`): KIND `text` is a directory of
{split}.{lang} files read as data.source=text reads them (data.train_split), `tfds` a TFDS builder (with
data.tfds_data_dir and data.tfds_download), `files` two plain files `SRC_FILE+TGT_FILE` (translate_corpus's input
and output, or the reverse for back-translation). A weight is the probability that the next training pair comes
from that corpus (`pipeline` mixes them); a tag (e.g. `<BT>`, Caswell et al. 2019) is written before every
non-empty source sentence of its corpus, and the tokenizer holds it as one piece (`tokenizer.check_tags`). Empty
data.corpora is the single corpus of data.source, as always.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Any

import ml_collections

from transformer_jax.config.checks import corpus_specs
from transformer_jax.data import sources
from transformer_jax.errors import DataError

KEY = "data.corpora"


@dataclasses.dataclass(frozen=True)
class Corpus:
    """One entry of data.corpora."""

    name: str
    kind: str  # text, tfds or files
    where: str  # the directory, the TFDS builder, or SRC_FILE+TGT_FILE
    weight: float  # > 0; the mix uses weight / sum of weights
    tag: str  # written before every non-empty source sentence; empty = none


def corpora(config: ml_collections.ConfigDict) -> list[Corpus]:
    """The corpora of data.corpora (`config` is the data group); empty when the single data.source is used."""
    return [Corpus(*spec) for spec in corpus_specs(config.corpora)]


class Tagged:
    """A training stream (`sources.TextPairs` or `TfdsPairs`) whose non-empty sources start with `tag` and a space.

    Empty sources stay empty, so the pipeline's length filter still drops them. Streams like its input: `len()`,
    `chunks(size)`, `pick(indices)`, `identity()` (which records the tag: a store of other tags is stale).
    """

    def __init__(self, stream: sources.TextPairs | sources.TfdsPairs, tag: str):
        self.stream, self.tag = stream, tag

    def __len__(self) -> int:
        return len(self.stream)

    def _tagged(self, pairs: Sequence[sources.Pair]) -> list[sources.Pair]:
        if not self.tag:
            return list(pairs)
        return [(f"{self.tag} {s}" if s.strip() else s, t) for s, t in pairs]

    def chunks(self, size: int) -> Iterator[tuple[int, list[sources.Pair]]]:
        for lines, pairs in self.stream.chunks(size):
            yield lines, self._tagged(pairs)

    def pick(self, indices: Sequence[int]) -> list[sources.Pair]:
        return self._tagged(self.stream.pick(indices))

    def identity(self) -> dict[str, Any]:
        return {**self.stream.identity(), "tag": self.tag}


def open_corpus(config: ml_collections.ConfigDict, corpus: Corpus) -> Tagged:
    """`corpus` opened for streaming, its tag applied; a missing or empty corpus is one DataError naming it."""
    about = f"{KEY}: corpus {corpus.name!r}"
    if corpus.kind == "text":
        directory = sources.resolve_path(corpus.where)
        if not directory.is_dir():
            raise DataError(f"{about}: the directory {directory} does not exist")
        stream = sources.TextPairs(directory, config.train_split, config.src_lang, config.tgt_lang)
    elif corpus.kind == "files":
        src, tgt = corpus.where.split("+")
        stream = sources.TextPairs.of_files(src, tgt, about)
    else:
        stream = sources.open_tfds_split(
            corpus.where,
            config.tfds_data_dir,
            config.train_split,
            config.src_lang,
            config.tgt_lang,
            download=config.tfds_download,
        )
    if not len(stream):  # text: both sides' lines counted here, so unequal sides fail before anything is decoded
        raise DataError(f"{about} ({corpus.where}) has no pairs")
    return Tagged(stream, corpus.tag)
