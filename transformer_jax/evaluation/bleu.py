"""Translation scores: sacreBLEU corpus BLEU, chrF, chrF++ and TER on detokenized text, and the paper-comparable
tokenized BLEU.

sacreBLEU (Post, 2018) scores detokenized output against raw references with its own tokenization and prints a
signature that makes the number reproducible; it is the score to report. Papers of the time (the Transformer
paper, GNMT, ConvS2S) reported BLEU on tokenized text with hyphenated compounds split, following tensor2tensor's
`get_ende_bleu.sh`: Moses-tokenize, rewrite `(\\S)-(\\S)` as `\\1 ##AT##-##AT## \\2`, then multi-bleu.perl. That
number is reproduced here with sacreBLEU's 13a tokenizer in place of the Moses tokenizer (not a dependency of this
project), reported separately and labelled, and never mixed up with sacreBLEU's.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from typing import Any

from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
from sacrebleu.tokenizers.tokenizer_intl import TokenizerV14International

from transformer_jax.data import sources
from transformer_jax.errors import ScoreError, UserError

TOKENIZED_BLEU_LABEL = "tokenized BLEU (tensor2tensor get_ende_bleu procedure, compound splitting)"
_COMPOUND = re.compile(r"(\S)-(\S)")  # the perl s{(\S)-(\S)}{$1 ##AT##-##AT## $2}g of get_ende_bleu.sh
_TOKENIZERS = {"13a": Tokenizer13a, "intl": TokenizerV14International}


def decode_lines(
    data: bytes, name: str, error: type[UserError] = ScoreError, first_line: int = 1, *, scored: bool = False
) -> list[str]:
    """UTF-8 bytes split at LF only, line endings removed; invalid UTF-8 raises `error` naming the line.
    `first_line`: the number of the first line of `data`. A byte-order mark at the start of the file follows
    `sources.leading_bom`: dropped from a model input, kept with a warning in a file that is only `scored`."""
    if first_line == 1:
        data = sources.leading_bom(data, name, scored=scored)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line_start = data.rfind(b"\n", 0, e.start) + 1
        line = data.count(b"\n", 0, e.start) + first_line
        raise error(
            f"{name}, line {line}: invalid UTF-8 ({e.reason}, byte {e.start - line_start + 1} of the line); "
            "convert the file to UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        ) from e
    lines = text.split("\n")
    if lines[-1] == "":  # the final line break ends the last line; it does not start an empty one
        lines.pop()
    return lines


def read_lines(path: str | os.PathLike) -> list[str]:
    """The lines of a UTF-8 text file exactly as the `sacrebleu` command reads them (split at LF, rstripped; a
    byte-order mark kept, and warned about)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ScoreError(f"cannot read {path}: {e.strerror or e}") from e
    return [line.rstrip() for line in decode_lines(data, str(path), scored=True)]


def check_line_counts(hypotheses: Sequence[str], references: Sequence[str], hyp_name: str, ref_name: str) -> None:
    if not hypotheses and not references:
        raise ScoreError(f"{hyp_name} and {ref_name} have no lines: nothing to score")
    if len(hypotheses) != len(references):
        raise ScoreError(
            f"line counts differ: {hyp_name} has {len(hypotheses)} lines, {ref_name} has {len(references)}; "
            "every hypothesis line needs exactly one reference line"
        )


def split_compounds(text: str) -> str:
    """'rich-text format' -> 'rich ##AT##-##AT## text format' (tensor2tensor get_ende_bleu.sh)."""
    return _COMPOUND.sub(r"\1 ##AT##-##AT## \2", text)


def tokenize_for_bleu(lines: Sequence[str], *, tokenizer: str = "13a") -> list[str]:
    """The lines as the tokenized BLEU scores them: tokenized (13a or intl), then compounds split."""
    tok = _TOKENIZERS[tokenizer]()
    return [split_compounds(tok(line)) for line in lines]


def tokenized_bleu(hypotheses: Sequence[str], references: Sequence[str], *, tokenizer: str = "13a") -> dict[str, Any]:
    """Corpus BLEU on tokenized, compound-split text (tokenizer 13a or intl; then no further tokenization)."""
    bleu = BLEU(tokenize="none", force=True)
    score = bleu.corpus_score(
        tokenize_for_bleu(hypotheses, tokenizer=tokenizer), [tokenize_for_bleu(references, tokenizer=tokenizer)]
    )
    return {
        "name": TOKENIZED_BLEU_LABEL,
        "score": score.score,
        "procedure": f"sacrebleu {tokenizer} tokenizer, then (\\S)-(\\S) -> ##AT##-##AT##, then BLEU with tok:none",
        "verbose": _verbose(score),
        "signature": str(bleu.get_signature()),
    }


def _verbose(score: Any) -> str:
    # "BLEU = 27.31 58.6/33.1/... (BP = ...)" without the leading name and score.
    return score.format(width=2).split(" ", 3)[-1]


def sacrebleu_scores(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, dict[str, Any]]:
    """sacreBLEU corpus BLEU, chrF, chrF++ (`-m chrf --chrf-word-order 2`) and TER with the `sacrebleu` command's
    settings."""
    out = {}
    metrics = {"bleu": BLEU(), "chrf": CHRF(), "chrfpp": CHRF(word_order=2), "ter": TER()}
    for key, metric in metrics.items():
        score = metric.corpus_score(list(hypotheses), [list(references)])
        out[key] = {
            "name": score.name,
            "score": score.score,
            "signature": str(metric.get_signature()),
            "verbose": _verbose(score) if key == "bleu" else "",
        }
    return out


def score_all(hypotheses: Sequence[str], references: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{'bleu', 'chrf', 'chrfpp', 'ter', 'tokenized_bleu'}: each with 'score' (0-100), 'signature' and a description.

    Every line counts, blank ones too, as the `sacrebleu` command counts them: an empty hypothesis matches nothing
    and adds its reference's length. No lines at all is an error (sacreBLEU has no score for an empty corpus).
    """
    check_line_counts(hypotheses, references, "the hypotheses", "the references")
    scores = sacrebleu_scores(hypotheses, references)
    scores["tokenized_bleu"] = tokenized_bleu(hypotheses, references)
    return scores


def score_files(hyp_path: str | os.PathLike, ref_path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    hypotheses, references = read_lines(hyp_path), read_lines(ref_path)
    check_line_counts(hypotheses, references, str(hyp_path), str(ref_path))
    return score_all(hypotheses, references)


def format_scores(scores: dict[str, dict[str, Any]]) -> str:
    """Human-readable lines, two decimals each, with the signatures."""
    bleu, tok = scores["bleu"], scores["tokenized_bleu"]
    lines = [f"sacreBLEU {bleu['name']} = {bleu['score']:.2f}  {bleu['verbose']}  signature: {bleu['signature']}"]
    for score in (scores["chrf"], scores["chrfpp"], scores["ter"]):
        lines.append(f"sacreBLEU {score['name']} = {score['score']:.2f}  signature: {score['signature']}")
    lines.append(f"{tok['name']} = {tok['score']:.2f}  {tok['verbose']}  ({tok['procedure']})")
    return "\n".join(lines)
