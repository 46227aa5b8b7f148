"""The vocabulary of a Hugging Face M2M-100 or NLLB-200 folder, read into what a workdir's tokenizer
(data.tokenizer="fairseq", data/tokenizer.py FairseqTokenizer) and its code table (model.language_codes) hold.

Both families use fairseq's dictionary: `<s>` 0, `<pad>` 1, `</s>` 2, `<unk>` 3, then the SentencePiece pieces
(sentencepiece.bpe.model), then the language codes. Every id is read from the folder, never assumed from an order:
- NLLB-200 (NllbTokenizer): tokenizer.json, its BPE model's vocab (piece -> id) and its `added_tokens` (the
  specials, `<mask>`, the codes `eng_Latn`: every added token of that form; with their ids), and
  tokenizer_config.json's `legacy_behaviour` (sources `X </s> [src_code]` instead of `[src_code] X </s>`);
- M2M-100 (M2M100Tokenizer): vocab.json (piece -> id, ids 0 .. n-1), then the codes `__xx__` of the list that
  tokenizer_config.json's `language_codes` names (m2m100 or wmt21, languages.M2M100_CODES) at ids n + i, then
  `num_madeup_words` (default 8) words `madeupword0000` ... after them.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
from pathlib import Path
from typing import Any

from transformer_jax.data import languages
from transformer_jax.data.tokenizer import FAIRSEQ_SPM, FAIRSEQ_VOCAB
from transformer_jax.errors import DataError

CONFIG, TOKENIZER_JSON, TOKENIZER_CONFIG, VOCAB = "config.json", "tokenizer.json", "tokenizer_config.json", "vocab.json"
# fairseq's special pieces and the config.json keys that give their ids
SPECIALS = {"<s>": "bos_token_id", "<pad>": "pad_token_id", "</s>": "eos_token_id", "<unk>": "unk_token_id"}
NLLB_CODE = re.compile(r"[a-z]{3}_[A-Z][a-z]{3}")  # eng_Latn: ISO 639-3 and ISO 15924 script
MADEUP_WORD = "madeupword{:04d}"  # fairseq's padding of M2M-100's dictionary to a multiple of 8


@dataclasses.dataclass(frozen=True)
class Vocabulary:
    pieces: dict[str, int]  # every id the tokenizer names: what the workdir's vocab.json holds
    codes: dict[str, int]  # language code -> id: model.language_codes
    spm: Path  # the folder's sentencepiece.bpe.model
    legacy_behaviour: bool  # NLLB's sources X </s> [src_code]


def _json(path: Path, required: bool = True) -> Any:
    if not path.is_file():
        if required:
            raise DataError(f"{path} is missing; give a Hugging Face M2M-100 or NLLB-200 folder with its tokenizer")
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path} cannot be read as JSON: {e}") from None


def _ids(path: Path, entries: list[tuple[str, Any]]) -> dict[str, int]:
    """piece -> id of (piece, id) entries; DataError naming `path` for an id that is not an integer >= 0, or a piece
    or id given twice with different partners."""
    pieces: dict[str, int] = {}
    owner: dict[int, str] = {}
    for piece, i in entries:
        if type(i) is not int or i < 0:
            raise DataError(f"{path}: piece {piece!r} has id {i!r}; ids are integers >= 0")
        if pieces.get(piece, i) != i:
            raise DataError(f"{path}: {piece!r} has two ids, {pieces[piece]} and {i}; the file is damaged")
        if owner.get(i, piece) != piece:
            raise DataError(f"{path}: id {i} is both {owner[i]!r} and {piece!r}; the file is damaged")
        pieces[piece], owner[i] = i, piece
    return pieces


def _nllb(folder: Path, tokenizer_config: dict) -> tuple[dict[str, int], dict[str, int], bool]:
    path = folder / TOKENIZER_JSON
    tokenizer = _json(path)
    model = (tokenizer.get("model") if isinstance(tokenizer, dict) else None) or {}
    if model.get("type") != "BPE" or not isinstance(model.get("vocab"), dict):
        raise DataError(f"{path}: model type {model.get('type')!r}; NLLB-200's tokenizer.json holds a BPE vocab")
    added = tokenizer.get("added_tokens") or []
    if not all(isinstance(t, dict) and isinstance(t.get("content"), str) for t in added):
        raise DataError(f"{path}: added_tokens must be objects with a content and an id")
    pieces = _ids(path, [*model["vocab"].items(), *((t["content"], t.get("id")) for t in added)])
    codes = {t["content"]: t["id"] for t in added if NLLB_CODE.fullmatch(t["content"])}
    if not codes:
        raise DataError(f"{path} has no language code (an added token such as eng_Latn); it is not NLLB-200's")
    legacy = tokenizer_config.get("legacy_behaviour", False)
    if not isinstance(legacy, bool):
        raise DataError(f"{folder / TOKENIZER_CONFIG}: legacy_behaviour must be true or false, got {legacy!r}")
    return pieces, codes, legacy


def _m2m100(folder: Path, tokenizer_config: dict) -> tuple[dict[str, int], dict[str, int], bool]:
    path = folder / VOCAB
    vocab = _json(path)
    if not isinstance(vocab, dict):
        raise DataError(f"{path} is not a JSON object of piece -> id")
    pieces = _ids(path, list(vocab.items()))
    if sorted(pieces.values()) != list(range(len(pieces))):
        raise DataError(f"{path} must map its pieces to the ids 0 .. {len(pieces) - 1}, each once (M2M100Tokenizer's)")
    name = tokenizer_config.get("language_codes", "m2m100")
    madeup = tokenizer_config.get("num_madeup_words", 8)
    if name not in languages.M2M100_CODES or type(madeup) is not int or madeup < 0:
        raise DataError(
            f"{folder / TOKENIZER_CONFIG}: language_codes={name!r}, num_madeup_words={madeup!r}; expected one of "
            f"{sorted(languages.M2M100_CODES)} and a count"
        )
    codes = {f"__{code}__": len(vocab) + i for i, code in enumerate(languages.M2M100_CODES[name])}
    words = {MADEUP_WORD.format(i): len(vocab) + len(codes) + i for i in range(madeup)}
    clash = sorted((codes.keys() | words.keys()) & pieces.keys())
    if clash:
        raise DataError(f"{path} holds {clash[:3]}, which M2M100Tokenizer places after its pieces; the file is damaged")
    return {**pieces, **codes, **words}, codes, False


def read_vocabulary(folder: Path) -> Vocabulary:
    """The vocabulary of an NLLB-200 folder (tokenizer.json) or an M2M-100 folder (vocab.json), by
    tokenizer_config.json's tokenizer_class or else the file present; DataError naming the file that is missing
    or disagrees (with itself, or with config.json's special ids)."""
    folder = Path(folder)
    tokenizer_config = _json(folder / TOKENIZER_CONFIG, required=False)
    if not isinstance(tokenizer_config, dict):
        raise DataError(f"{folder / TOKENIZER_CONFIG} is not a JSON object")
    kind = str(tokenizer_config.get("tokenizer_class", ""))
    if kind.startswith(("Nllb", "M2M100")):
        nllb = kind.startswith("Nllb")
    elif (folder / TOKENIZER_JSON).is_file() or (folder / VOCAB).is_file():
        nllb = (folder / TOKENIZER_JSON).is_file()
    else:
        raise DataError(f"{folder} has neither {TOKENIZER_JSON} (NLLB-200) nor {VOCAB} (M2M-100)")
    pieces, codes, legacy = (_nllb if nllb else _m2m100)(folder, tokenizer_config)
    source = folder / (TOKENIZER_JSON if nllb else VOCAB)
    hf = _json(folder / CONFIG)
    for piece, key in SPECIALS.items():
        expected = hf.get(key, list(SPECIALS).index(piece))  # config.json may leave unk out: fairseq's 3
        if pieces.get(piece) != expected:
            raise DataError(f"{source} gives {piece} id {pieces.get(piece)} but {folder / CONFIG} {key} is {expected}")
    spm = folder / FAIRSEQ_SPM
    if not spm.is_file():
        raise DataError(f"{spm} is missing; the folder's SentencePiece model is what encodes text into its pieces")
    return Vocabulary(pieces, codes, spm, legacy)


def write_vocabulary(vocab: Vocabulary, workdir: Path) -> None:
    """Writes the workdir's tokenizer files: the SentencePiece model and vocab.json (every piece, in id order)."""
    workdir = Path(workdir)
    shutil.copyfile(vocab.spm, workdir / FAIRSEQ_SPM)
    ordered = dict(sorted(vocab.pieces.items(), key=lambda item: item[1]))
    (workdir / FAIRSEQ_VOCAB).write_text(json.dumps(ordered, ensure_ascii=False, indent=0), encoding="utf-8")
