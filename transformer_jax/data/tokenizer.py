"""The tokenizers: one joint SentencePiece vocabulary trained here (`data.tokenizer="spm"`, the default), a converted
Marian model's (`"marian"`: source and target SentencePiece models whose pieces map to ids through vocab.json, and
target_vocab.json when the vocabularies are separate), or a converted M2M-100 / NLLB-200 model's (`"fairseq"`: one
SentencePiece model whose pieces map to ids through vocab.json, and the model's language codes, model.language_codes).

All have one interface, which every user of a tokenizer goes through: `encode_source(text)` / `encode_target(text)`
-> ids without EOS (the pipeline appends it), their `_batch` forms, `decode_target(ids)` -> text (reserved ids
dropped, up to the first EOS), the pieces of ids on either side, `ids` (model.layers.SpecialIds), `vocab_size` (the
target's: the output softmax), `source_vocab_size`, and `fingerprint()`, what the tokenized store is keyed on. With
`target_lang` (data.target_lang), every source starts with the one id of its `>>lang<<` token.

A SentencePiece model trained here reserves the config's ids (`model.*_id`), and a reused one must reserve the same.
It is trained with identity normalization, no whitespace folding and byte fallback, so `decode(encode(s)) == s` for
any string: BLEU is computed on exactly the text the tokenizer was given, and no character becomes <unk>. A Marian
tokenizer gives the ids transformers' MarianTokenizer gives. With data.corpora, the model trained here learns from
a sample of the mix (each corpus's share by its weight) and holds each corpus tag as a user-defined symbol, one
piece never split; any tokenizer that would split a tag or map it to <unk> is refused (`check_tags`).

A multilingual run (data.directions) trains its model with model.vocab_size - L pieces, L its languages, on a sample
balanced across languages (`language_sample`); the Tokenizer then knows the languages: their ids follow the pieces
(languages.Placement's table), text never encodes to one, decoding drops them, and their pieces are their codes
`>>xx<<`. Placing them in a sequence is the batches' business (languages.Placement), not the tokenizer's.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import json
import os
import random
import zlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import ml_collections
import numpy as np
import sentencepiece as spm
from absl import logging

from transformer_jax.data import languages, sources
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.model.layers import SpecialIds

MODEL_FILENAME = "spm.model"
# A converted Marian model's tokenizer in the workdir: transformers' MarianTokenizer files, under their names there.
MARIAN_SOURCE_SPM = "source.spm"
MARIAN_TARGET_SPM = "target.spm"
MARIAN_VOCAB = "vocab.json"  # piece -> id, the source's, and the target's unless MARIAN_TARGET_VOCAB exists
MARIAN_TARGET_VOCAB = "target_vocab.json"
MARIAN_REQUIRED = (MARIAN_SOURCE_SPM, MARIAN_TARGET_SPM, MARIAN_VOCAB)
MARIAN_SPECIAL_PIECES = {"eos": "</s>", "unk": "<unk>", "pad": "<pad>"}  # the pieces of the reserved ids
# A converted M2M-100 / NLLB-200 model's tokenizer in the workdir (interop/m2m100_vocab.py writes them).
FAIRSEQ_SPM = "sentencepiece.bpe.model"
FAIRSEQ_VOCAB = "vocab.json"  # piece -> id of every id the tokenizer names: specials, pieces, codes, added tokens
SURPLUS_PIECE = "<surplus{}>"  # the piece of an embedding row past the vocabulary (NLLB-200 has 2)
SPIECE_UNDERLINE = "\u2581"


def _language_code(text: str) -> tuple[list[str], str]:
    """(a leading `>>xx<<` code, the rest): MarianTokenizer's remove_language_code, so texts given with a code
    encode as there."""
    if text.startswith(">>") and (end := text.find("<<")) != -1:
        return [text[: end + 2]], text[end + 2 :]
    return [], text


def _load_spm(path: Path) -> spm.SentencePieceProcessor:
    try:
        proto = path.read_bytes()
    except OSError as e:
        raise DataError(f"cannot read tokenizer model {path}: {e.strerror or e}") from e
    sp = spm.SentencePieceProcessor()
    try:
        sp.LoadFromSerializedProto(proto)
    except Exception as e:  # sentencepiece raises RuntimeError/OSError with a terse message on bad files
        raise DataError(f"{path} is not a SentencePiece model: {e}") from e
    return sp


def marian_files(directory: Path) -> list[Path]:
    """The files of a converted Marian model's tokenizer in `directory`: MARIAN_REQUIRED, and the target
    vocabulary where it has its own."""
    names = MARIAN_REQUIRED + ((MARIAN_TARGET_VOCAB,) if (directory / MARIAN_TARGET_VOCAB).exists() else ())
    return [directory / name for name in names]


class _Encoder:
    """What both tokenizers derive from their batch forms."""

    def encode_source(self, text: str) -> list[int]:
        return self.encode_source_batch([text])[0]

    def encode_target(self, text: str) -> list[int]:
        return self.encode_target_batch([text])[0]

    def decode_target_batch(self, batch: Iterable[Iterable[int]]) -> list[str]:
        return [self.decode_target(ids) for ids in batch]


class Tokenizer(_Encoder):
    """A joint SentencePiece model that reserves `ids` (the config's); ids are SentencePiece's own. With
    `language_table` (a multilingual run's languages.Placement), the languages' ids follow the pieces: the vocabulary
    is pieces + languages, and a language id is never text (see the module docstring). Built from a full config
    (model_tokenizer), the table is languages.Placement.of(config): its scheme is the model's model.lang_token."""

    name = "spm"

    def __init__(
        self,
        model_path: str | os.PathLike,
        ids: SpecialIds,
        target_lang: str = "",
        language_table: languages.Placement | None = None,
    ):
        self.path = Path(model_path)
        self.files = (self.path,)
        self.ids = ids
        self._sp = _load_spm(self.path)
        found = (self._sp.pad_id(), self._sp.eos_id(), self._sp.bos_id(), self._sp.unk_id())
        reserved = (ids.pad, ids.eos, ids.bos, ids.unk)
        if found != reserved:
            raise DataError(
                f"tokenizer {self.path} reserves (pad, eos, bos, unk) = {found}; the config's model.pad_id, eos_id, "
                f"bos_id, unk_id are {reserved}: use a matching tokenizer or set those keys"
            )
        self.target_lang = target_lang
        self._prefix = [] if not target_lang else [_language_id(self, target_lang, self._sp.piece_to_id)]
        self.language_table = language_table
        # get_tokenizer checks that the language ids follow the pieces (`pieces` <= language_table.first_id).
        self._codes = {} if language_table is None else {i: languages.code(x) for x, i in language_table.ids.items()}

    @property
    def pieces(self) -> int:
        """The SentencePiece model's pieces: ids 0 .. pieces - 1, all that text encodes to."""
        return self._sp.get_piece_size()

    @property
    def vocab_size(self) -> int:
        """The pieces, and after them the languages' ids when it has languages."""
        return max(self._codes) + 1 if self._codes else self.pieces

    source_vocab_size = vocab_size

    def language_id(self, lang: str) -> int:
        """The id of a language named by its suffix or its code >>xx<< (ConfigError for one it lacks)."""
        if self.language_table is None:
            raise ConfigError(f"language {lang!r}: this tokenizer has no language tokens (data.directions is empty)")
        return self.language_table.id(lang)

    def fingerprint(self) -> str:
        """What a store tokenized with this tokenizer depends on: its model file (and the language token, or the
        languages: their ids follow the pieces)."""
        digest = hashlib.sha256(self.path.read_bytes()).hexdigest()
        if self._codes:
            digest += "+" + ",".join(f"{code}={i}" for i, code in sorted(self._codes.items()))
        return digest if not self.target_lang else f"{digest}+{languages.code(self.target_lang)}"

    def encode_source_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        """Encodes many strings in one call; `num_threads` threads inside SentencePiece (1 = this core only)."""
        return [self._prefix + x for x in self._sp.encode(list(texts), num_threads=num_threads)]

    def encode_target_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self._sp.encode(list(texts), num_threads=num_threads)

    def decode_target(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS, on one line (`one_line`); padding and BOS are dropped (model outputs
        can be passed as is)."""
        drop = (self.ids.pad, self.ids.bos, *self._codes)
        return one_line(self._sp.decode(_content(ids, self.ids, drop=drop)))

    def source_pieces(self, ids: Iterable[int]) -> list[str]:
        """The pieces of `ids`; a language id's is its code `>>xx<<`."""
        codes = self._codes
        return [codes[i] if i in codes else self._sp.id_to_piece(i) for i in map(int, ids)]

    target_pieces = source_pieces


class MarianTokenizer(_Encoder):
    """A converted Marian model's tokenizer in `directory` (MARIAN_* files): source text through source.spm, target
    text through target.spm, pieces to ids through vocab.json (target_vocab.json for the target when it exists); a
    piece missing from the map is unk. Gives the ids transformers' MarianTokenizer gives for the same text."""

    name = "marian"

    def __init__(self, directory: str | os.PathLike, ids: SpecialIds, target_lang: str = ""):
        self.directory = Path(directory)
        self.path = self.directory / MARIAN_VOCAB
        self.ids = ids
        target_vocab = self.directory / MARIAN_TARGET_VOCAB
        self.files = tuple(marian_files(self.directory))
        self._source_sp = _load_spm(self.directory / MARIAN_SOURCE_SPM)
        self._target_sp = _load_spm(self.directory / MARIAN_TARGET_SPM)
        self._source_map = _load_vocab(self.path, ids)
        self._target_map = _load_vocab(target_vocab, ids) if target_vocab.exists() else self._source_map
        self._source_pieces = {i: p for p, i in self._source_map.items()}
        self._target_pieces = {i: p for p, i in self._target_map.items()}
        self.target_lang = target_lang
        self._prefix = [] if not target_lang else [_language_id(self, target_lang, self._source_map.get)]

    @property
    def vocab_size(self) -> int:
        return len(self._target_map)

    @property
    def source_vocab_size(self) -> int:
        return len(self._source_map)

    def fingerprint(self) -> str:
        """What a store tokenized with this tokenizer depends on: every file's name and contents, the language token."""
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
        digest.update(languages.code(self.target_lang).encode() if self.target_lang else b"")
        return digest.hexdigest()

    def _encode(self, sp: spm.SentencePieceProcessor, vocab: dict, texts: Sequence[str], num_threads: int):
        codes, rests = zip(*map(_language_code, texts), strict=True) if texts else ((), ())
        pieces = sp.encode(list(rests), out_type=str, num_threads=num_threads)
        unk = self.ids.unk
        return [[vocab.get(p, unk) for p in (*c, *ps)] for c, ps in zip(codes, pieces, strict=True)]

    def encode_source_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return [self._prefix + x for x in self._encode(self._source_sp, self._source_map, texts, num_threads)]

    def encode_target_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        return self._encode(self._target_sp, self._target_map, texts, num_threads)

    def decode_target(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS, every reserved id dropped (MarianTokenizer's decode with
        skip_special_tokens), on one line (`one_line`)."""
        drop = (self.ids.pad, self.ids.bos, self.ids.unk)
        pieces = [self._target_pieces[i] for i in _content(ids, self.ids, drop=drop)]
        return one_line(self._target_sp.decode_pieces(pieces).replace(SPIECE_UNDERLINE, " ").strip())

    def source_pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._source_pieces[int(i)] for i in ids]

    def target_pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._target_pieces[int(i)] for i in ids]


class FairseqTokenizer(_Encoder):
    """A converted M2M-100 or NLLB-200 model's tokenizer in `directory`: text through FAIRSEQ_SPM into pieces, pieces
    to ids through FAIRSEQ_VOCAB (a piece missing from it is unk), as transformers' M2M100Tokenizer and NllbTokenizer
    do; the language codes are `language_table`'s (languages.Placement.of the config: model.language_codes). Text
    never encodes to a code or a special (a sentence holding "eng_Latn" is ordinary pieces).

    Trailing spaces: the text is encoded by the SentencePiece model as fairseq encoded the model's training data, so
    its normalizer decides; NLLB-200's and M2M-100's drop trailing (and repeated) spaces. transformers' NllbTokenizer
    (the `tokenizers` library) keeps a trailing space as one more piece `▁`: a line ending in a space is the one
    place where its ids differ from these (and from M2M100Tokenizer's, which uses SentencePiece as here).

    Decoding does what the oracles' decode(ids, skip_special_tokens=True) does: ids up to the first EOS (a leading
    BOS, the decoder's first input, dropped), keeping only the SentencePiece model's own pieces (so pad, <s>, unk,
    <mask>, the codes, M2M-100's madeup words and the surplus rows are dropped), detokenised by SentencePiece with
    the outer spaces stripped: M2M100Tokenizer's text; NllbTokenizer's keeps a space where the ids start with a lone
    `▁` before a dropped id (unk) or end with one.
    `vocab_size` is the model's embedding rows (model.vocab_size), which may exceed the vocabulary: a row past it has
    the piece SURPLUS_PIECE."""

    name = "fairseq"

    def __init__(
        self, directory: str | os.PathLike, ids: SpecialIds, vocab_size: int, language_table: languages.Placement
    ):
        self.directory = Path(directory)
        self.path = self.directory / FAIRSEQ_VOCAB
        self.files = (self.directory / FAIRSEQ_SPM, self.path)
        self.ids = ids
        self.target_lang = ""
        self.language_table = language_table
        self._sp = _load_spm(self.files[0])
        self._map = _load_vocab(self.path, ids, contiguous=False)
        outside = [(p, i) for p, i in self._map.items() if i >= vocab_size][:3]
        if outside:
            raise DataError(
                f"{self.path} gives {outside} ids at or past model.vocab_size={vocab_size}; the vocabulary and the "
                "config are of different models"
            )
        self._pieces = {i: p for p, i in self._map.items()}
        self._vocab_size = vocab_size
        sp = self._sp
        self._text = frozenset(
            i for p, i in self._map.items() if (j := sp.piece_to_id(p)) != sp.unk_id() and not sp.is_control(j)
        )

    @property
    def pieces(self) -> int:
        """The ids text encodes to (the SentencePiece model's pieces in vocab.json)."""
        return len(self._text)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    source_vocab_size = vocab_size

    def language_id(self, lang: str) -> int:
        """The id of the model's code for a language as a user names it (languages.resolve)."""
        return self.language_table.id(lang)

    def fingerprint(self) -> str:
        """What a store tokenized with this tokenizer depends on: every file's name and contents, the code table."""
        digest = hashlib.sha256()
        for file in self.files:
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
        digest.update(",".join(f"{code}={i}" for code, i in sorted(self.language_table.ids.items())).encode())
        return digest.hexdigest()

    def encode_source_batch(self, texts: Sequence[str], num_threads: int = 1) -> list[list[int]]:
        pieces = self._sp.encode(list(texts), out_type=str, num_threads=num_threads)
        vocab, unk = self._map, self.ids.unk
        return [[vocab.get(p, unk) for p in line] for line in pieces]

    encode_target_batch = encode_source_batch

    def decode_target(self, ids: Iterable[int]) -> str:
        """The text of `ids` up to the first EOS, only the SentencePiece model's pieces kept, on one line (see the
        class docstring)."""
        text = self._text
        pieces = [self._pieces[i] for i in _content(ids, self.ids, drop=()) if i in text]
        return one_line(self._sp.decode_pieces(pieces).strip())

    def source_pieces(self, ids: Iterable[int]) -> list[str]:
        return [self._pieces.get(i, SURPLUS_PIECE.format(i)) for i in map(int, ids)]

    target_pieces = source_pieces


# str.splitlines' line boundaries. A translation is one line of a file, but byte-fallback pieces (<0x0A>, <0x0C>, ...)
# decode to any character: a sampled one would shift every later line of translate_corpus's or evaluate.py's output.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_ONE_LINE = str.maketrans(dict.fromkeys(LINE_BREAKS, " "))


def one_line(text: str) -> str:
    """`text` with each line boundary replaced by a space."""
    return text.translate(_ONE_LINE)


def _content(ids: Iterable[int], reserved: SpecialIds, *, drop: tuple[int, ...]) -> list[int]:
    """ids up to the first EOS, those in `drop` left out. A leading BOS (the decoder's first input, not an emission)
    is dropped before EOS is looked for: where bos = eos (fairseq's decoder starts from `</s>`) it ends nothing."""
    ids = list(map(int, ids))
    if ids and ids[0] == reserved.bos:
        ids = ids[1:]
    return [i for i in itertools.takewhile(lambda i: i != reserved.eos, ids) if i not in drop]


def _load_vocab(path: Path, ids: SpecialIds, contiguous: bool = True) -> dict[str, int]:
    """A vocab.json (piece -> id): distinct ids (0 .. n-1, if `contiguous`: Marian's), the reserved pieces at the
    config's ids."""
    try:
        vocab = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"cannot read the vocabulary {path}: {e}") from e
    ok = isinstance(vocab, dict) and all(type(i) is int and i >= 0 for i in vocab.values())
    values = sorted(vocab.values()) if ok else []
    if not ok or len(set(values)) != len(values):
        raise DataError(f"{path} is not a vocabulary: it must map each piece to an id of its own")
    if contiguous and values != list(range(len(vocab))):
        raise DataError(f"{path} is not a Marian vocabulary: it must map each piece to one of the ids 0 .. n-1")
    for field, piece in MARIAN_SPECIAL_PIECES.items():
        if vocab.get(piece) != getattr(ids, field):
            raise DataError(
                f"{path} has {piece} at id {vocab.get(piece)}, but model.{field}_id is {getattr(ids, field)}: "
                "set the config's reserved ids to the vocabulary's"
            )
    return vocab


def _language_id(tokenizer: Tokenizer | MarianTokenizer, lang: str, lookup) -> int:
    """The id of `>>lang<<`, which must be one entry of the source vocabulary."""
    token = languages.code(lang)
    i = lookup(token)
    if i is None or tokenizer.source_pieces([i]) != [token]:
        raise DataError(
            f"data.target_lang={lang!r}: the source vocabulary of {tokenizer.path} has no token {token}; "
            "choose a language the model was trained with"
        )
    return int(i)


def train_tokenizer(
    sentences: Iterable[str],
    model_path: str | os.PathLike,
    *,
    vocab_size: int,
    model_type: str,
    ids: SpecialIds,
    symbols: Sequence[str] = (),
) -> Tokenizer:
    """Trains a SentencePiece model (unigram or bpe) reserving `ids` on `sentences`; writes it atomically to
    `model_path`. `symbols` (corpus tags) become user-defined pieces: one id each, never split."""
    for other in ("pad", "eos"):  # SentencePiece reserves a piece of its own for each
        if ids.bos == getattr(ids, other):
            raise DataError(
                f"a SentencePiece model trained here needs model.bos_id ({ids.bos}) other than model.{other}_id; "
                "set them apart, or give the workdir a converted model's tokenizer"
            )
    if model_type not in ("unigram", "bpe"):
        raise DataError(f"unknown data.tokenizer_type {model_type!r}; choose unigram or bpe")
    model_path = Path(model_path)
    with sources.atomic_write(model_path) as tmp:
        # SentencePiece writes `prefix.model` and `prefix.vocab`; train under a temporary prefix and rename.
        prefix = f"{tmp}.sp"
        try:
            spm.SentencePieceTrainer.train(
                sentence_iterator=iter(sentences),
                model_prefix=prefix,
                vocab_size=vocab_size,
                model_type=model_type,
                pad_id=ids.pad,
                eos_id=ids.eos,
                bos_id=ids.bos,
                unk_id=ids.unk,
                user_defined_symbols=list(symbols),
                # Exact roundtrip: no Unicode normalization, keep every space, spell unknown characters as bytes.
                normalization_rule_name="identity",
                remove_extra_whitespaces=False,
                byte_fallback=True,
                input_sentence_size=0,  # the caller already sampled
                num_threads=os.cpu_count() or 1,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise DataError(f"SentencePiece training failed (vocab_size={vocab_size}, {model_type}): {e}") from e
        finally:
            Path(f"{prefix}.vocab").unlink(missing_ok=True)
        os.replace(f"{prefix}.model", tmp)
    return Tokenizer(model_path, ids)


def sample_sentences(pairs: sources.TextPairs | sources.TfdsPairs, num_sentences: int, *, seed: int = 0) -> list[str]:
    """About `num_sentences` sentences, both sides of a seeded uniform sample of pairs, empty sides left out; drawn
    by index and read in one streaming pass, so a corpus of any size is never held whole."""
    num_pairs = min(len(pairs), max(1, num_sentences // 2))
    indices = sorted(random.Random(seed).sample(range(len(pairs)), num_pairs))
    return [s for pair in pairs.pick(indices) for s in pair if s.strip()]


def pick_lines(path: Path, indices: Sequence[int]) -> list[str]:
    """The lines of `path` at sorted `indices`, read in one streaming pass, blank ones left out."""
    wanted = np.asarray(indices, np.int64)
    out: list[str] = []
    first = 0
    for lines in sources.iter_lines(path):
        lo, hi = np.searchsorted(wanted, [first, first + len(lines)])
        out += [line for line in (lines[i] for i in (wanted[lo:hi] - first).tolist()) if line.strip()]
        first += len(lines)
        if hi == len(wanted):
            break
    return out


def language_sample(
    files: Mapping[str, Path], num_sentences: int, temperature: float, used: Callable[[str, int], int] | None = None
) -> list[str]:
    """About `num_sentences` sentences balanced across languages (`files`: one file per language), so that a small
    language is not split into characters: language l's share is proportional to n_l^(1/T) (languages.probabilities,
    the temperature that samples the directions; n_l its lines), at most all its lines, drawn uniformly by index with
    a seed of its own (one file's sample is not the others' translations) in one streaming pass, blank lines left
    out. In a multi-way folder every n_l is equal, so the shares are too. `used(lang, lines)`: how many of a file's
    first lines the run trains on (languages.language_lines; default all), the lines n_l counts and the sample
    draws from."""
    langs = sorted(files)
    sizes = [sources.count_lines(files[lang]) for lang in langs]
    if used is not None:
        sizes = [used(lang, size) for lang, size in zip(langs, sizes, strict=True)]
    if not any(sizes):
        raise DataError(f"no lines to train the tokenizer on: {', '.join(str(files[x]) for x in langs)} are empty")
    out: list[str] = []
    for lang, size, p in zip(langs, sizes, languages.probabilities(sizes, temperature), strict=True):
        share = min(size, max(1, round(num_sentences * p)))
        indices = sorted(random.Random(zlib.crc32(lang.encode())).sample(range(size), share))
        out += pick_lines(files[lang], indices)
    return out


def training_sample(config: ml_collections.ConfigDict) -> list[str]:
    """The sentences a tokenizer is trained on (`config` is the data group): data.tokenizer_sample_sentences of
    the training split, or of the mix of data.corpora, each corpus sampled in proportion to its weight; of a
    multilingual run (data.directions), of the multi-way folder's languages (`language_sample`)."""
    if langs := languages.languages(config):
        files = languages.multiway_sides(config.text_dir, config.train_split, langs)
        used = functools.partial(languages.language_lines, config)
        return language_sample(files, config.tokenizer_sample_sentences, config.temperature, used)
    mix = sources.corpora(config)
    if not mix:
        return sample_sentences(sources.open_stream(config, config.train_split), config.tokenizer_sample_sentences)
    total = sum(c.weight for c in mix)
    out = []
    for corpus in mix:
        share = max(2, round(config.tokenizer_sample_sentences * corpus.weight / total))
        out.extend(sample_sentences(sources.open_corpus(config, corpus), share, seed=zlib.crc32(corpus.name.encode())))
    return out


def check_tags(tokenizer: Tokenizer | MarianTokenizer, config: ml_collections.ConfigDict, key: str) -> None:
    """Every tag of data.corpora must encode as one source piece of the tokenizer, never split nor <unk>;
    DataError naming the tag and `key` (the setting that chose the tokenizer) otherwise."""
    for corpus in sources.corpora(config):
        if not corpus.tag:
            continue
        ids = tokenizer.encode_source_batch([corpus.tag])[0][len(tokenizer.encode_source_batch([""])[0]) :]
        pieces = tokenizer.source_pieces(ids)
        if corpus.tag not in pieces or tokenizer.ids.unk in ids:
            raise DataError(
                f"data.corpora: the tag {corpus.tag!r} of corpus {corpus.name!r} is not one piece of the tokenizer "
                f"{tokenizer.path} ({key}); it would become {pieces}: use a tokenizer that holds it as a "
                "user-defined symbol, or leave the tokenizer to be trained here"
            )


def get_tokenizer(
    config: ml_collections.ConfigDict,
    workdir: str | os.PathLike,
    *,
    vocab_size: int,
    ids: SpecialIds,
    source_vocab_size: int = 0,
    train_if_missing: bool = True,
    lang_token: str = "none",
    language_codes: tuple = (),
) -> Tokenizer | MarianTokenizer | FairseqTokenizer:
    """The configured tokenizer (`config` is the data group). data.tokenizer="marian": the MARIAN_* files in the
    workdir (a converted model's); "fairseq": the FAIRSEQ_* files (a converted M2M-100 / NLLB-200 model's, whose
    codes are `language_codes`, model.language_codes). "spm": `config.tokenizer_model` if set, else
    `workdir/spm.model`, trained if missing. config.target_lang, when set, makes every source start with its
    `>>lang<<` token.

    `vocab_size`, `ids` and `source_vocab_size` are the model's (config.model.vocab_size, SpecialIds.of(config),
    config.model.source_vocab_size; 0 = vocab_size). A reused model must have exactly that many pieces (a different
    size means the workdir belongs to another config); a given SentencePiece model may be smaller.
    `train_if_missing=False` (multi-host runs: every host must use the same file) fails instead of training.
    Every tag of data.corpora must be one piece of it (`check_tags`).

    A multilingual run (data.directions, L languages) keeps the last L ids of vocab_size for the languages
    (languages.Placement): its SentencePiece model has vocab_size - L pieces (a given one at most that many).
    """
    path = Path(workdir) / MODEL_FILENAME
    table = _language_table(config, vocab_size, lang_token, language_codes)
    pieces = vocab_size if table is None else table.first_id
    if config.tokenizer == ("marian" if language_codes else "fairseq"):  # ours may have codes: data.add_languages
        raise DataError(
            f"data.tokenizer={config.tokenizer!r} with model.language_codes={'set' if language_codes else 'empty'}: "
            "a converted M2M-100 / NLLB-200 model's tokenizer (fairseq) and its code table come together"
        )
    if config.tokenizer == "fairseq":
        tokenizer = _fairseq_tokenizer(config, Path(workdir), ids, vocab_size, table)
        key = "data.tokenizer=fairseq"
    elif config.tokenizer == "marian":
        tokenizer = _marian_tokenizer(config, Path(workdir), ids, vocab_size, source_vocab_size or vocab_size)
        key = "data.tokenizer=marian"  # the setting that chose the tokenizer, for check_tags's message
    elif config.tokenizer_model:
        tokenizer = Tokenizer(sources.resolve_path(config.tokenizer_model), ids, config.target_lang, table)
        key = "data.tokenizer_model"
        if tokenizer.pieces > pieces:
            raise DataError(
                f"tokenizer {tokenizer.path} has {tokenizer.pieces} pieces but model.vocab_size is {vocab_size}"
                f"{_languages_part(table)}; ids would fall outside the embedding table"
                + ("" if table is None else " or take the languages' ids")
            )
    elif path.exists():
        tokenizer = Tokenizer(path, ids, config.target_lang, table)
        if tokenizer.pieces != pieces:
            raise DataError(
                f"{path} has {tokenizer.pieces} pieces but model.vocab_size is {vocab_size}{_languages_part(table)}; "
                "delete it to train a new one, or use the matching config"
            )
        logging.info("reusing tokenizer %s (%d pieces)", path, pieces)
        key = f"the workdir's {MODEL_FILENAME}, trained before: delete it to train one with the tags"
    elif not train_if_missing:
        raise DataError(
            f"{path} does not exist and this run may not train it (several hosts would each train their own): "
            "create it once with `python -m transformer_jax.data.prepare --config <the same config> --workdir "
            f"{workdir}` on a filesystem every host sees, or set data.tokenizer_model to an existing .model file"
        )
    else:
        sentences = training_sample(config)
        logging.info(
            "training a %s tokenizer with %d pieces on %d sentences", config.tokenizer_type, pieces, len(sentences)
        )
        tags = sorted({c.tag for c in sources.corpora(config) if c.tag})
        train_tokenizer(sentences, path, vocab_size=pieces, model_type=config.tokenizer_type, ids=ids, symbols=tags)
        tokenizer, key = Tokenizer(path, ids, config.target_lang, table), "data.tokenizer=spm"
    check_tags(tokenizer, config, key)
    return tokenizer


def _language_table(
    config: ml_collections.ConfigDict, vocab_size: int, lang_token: str, language_codes: tuple
) -> languages.Placement | None:
    """A multilingual run's or a converted model's language ids (languages.Placement's, of a model with `vocab_size`
    ids), or None; refuses the keys a multilingual run cannot use with them."""
    if not languages.languages(config) and not language_codes:
        return None
    # data.target_lang and a Marian tokenizer are refused with directions by the config's checks (cli.py).
    # The scheme that places the ids is the model's (model.lang_token, which model_tokenizer passes): the table is
    # the one Placement.of(full config) gives, so a caller placing ids from the tokenizer places them right.
    view = ml_collections.ConfigDict(
        {
            "data": config.to_dict(),
            "model": {"vocab_size": vocab_size, "lang_token": lang_token, "language_codes": language_codes},
        }
    )
    return languages.Placement.of(view)


def _languages_part(table: languages.Placement | None) -> str:
    """What a piece count is checked against, in an error message: a multilingual model's pieces."""
    return "" if table is None else f" - {len(table.ids)} languages = {table.first_id} pieces"


def model_tokenizer(
    config: ml_collections.ConfigDict, workdir: str | os.PathLike, *, train_if_missing: bool = True
) -> Tokenizer | MarianTokenizer | FairseqTokenizer:
    """`get_tokenizer` of a full config: its data group, with the model's vocabulary keys."""
    return get_tokenizer(
        config.data,
        workdir,
        vocab_size=config.model.vocab_size,
        ids=SpecialIds.of(config),
        source_vocab_size=config.model.source_vocab_size,
        train_if_missing=train_if_missing,
        lang_token=config.model.lang_token,
        language_codes=tuple(config.model.get("language_codes", ())),
    )


def tokenizer_files(config: ml_collections.ConfigDict, directory: str | os.PathLike) -> list[Path]:
    """The files of the tokenizer a workdir holds under `config` (the data group): what a fine-tuning run copies."""
    directory = Path(directory)
    if config.tokenizer == "marian":
        return marian_files(directory)
    if config.tokenizer == "fairseq":
        return [directory / FAIRSEQ_SPM, directory / FAIRSEQ_VOCAB]
    return [Path(config.tokenizer_model).expanduser() if config.tokenizer_model else directory / MODEL_FILENAME]


def _marian_tokenizer(
    config: ml_collections.ConfigDict, workdir: Path, ids: SpecialIds, vocab_size: int, source_vocab_size: int
) -> MarianTokenizer:
    if config.tokenizer_model:
        raise DataError(
            f"data.tokenizer_model={config.tokenizer_model!r} names a SentencePiece model, but data.tokenizer is "
            f"'marian', whose files are the workdir's ({MARIAN_SOURCE_SPM}, {MARIAN_TARGET_SPM}, {MARIAN_VOCAB}); "
            "leave data.tokenizer_model empty"
        )
    missing = [name for name in MARIAN_REQUIRED if not (workdir / name).is_file()]
    if missing:
        raise DataError(
            f"data.tokenizer='marian' needs {', '.join(missing)} in {workdir}: convert the model into this workdir "
            "with `python -m transformer_jax.convert --from_marian DIR --workdir WORKDIR`"
        )
    tokenizer = MarianTokenizer(workdir, ids, config.target_lang)
    for side, file, found, expected, key in (
        ("target", tokenizer.files[-1], tokenizer.vocab_size, vocab_size, "model.vocab_size"),
        ("source", tokenizer.path, tokenizer.source_vocab_size, source_vocab_size, "model.source_vocab_size"),
    ):
        if found != expected:
            raise DataError(
                f"{file} holds {found} {side} pieces but {key} is {expected}: the model's embedding rows must be "
                "the vocabulary's"
            )
    return tokenizer


def _fairseq_tokenizer(
    config: ml_collections.ConfigDict, workdir: Path, ids: SpecialIds, vocab_size: int, table: languages.Placement
) -> FairseqTokenizer:
    for key in ("tokenizer_model", "target_lang"):
        if config[key]:
            raise DataError(
                f"data.{key}={config[key]!r}: data.tokenizer='fairseq' reads the workdir's {FAIRSEQ_SPM} and "
                f"{FAIRSEQ_VOCAB} and names languages by their codes (--target_lang, data.directions); leave it empty"
            )
    missing = [name for name in (FAIRSEQ_SPM, FAIRSEQ_VOCAB) if not (workdir / name).is_file()]
    if missing:
        raise DataError(
            f"data.tokenizer='fairseq' needs {', '.join(missing)} in {workdir}: convert the model into this workdir "
            "with `python -m transformer_jax.convert --from_hf DIR --workdir WORKDIR`"
        )
    return FairseqTokenizer(workdir, ids, vocab_size, table)
