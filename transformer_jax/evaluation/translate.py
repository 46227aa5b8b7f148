"""Translate a list of sentences and score the translations.

Translating: tokenize, search (decoding.Searcher.sentences), detokenize, in input order. Source lengths are rounded
up to a bucket (16, 32, 64, ... up to max_input_len) so that jit compiles a bounded number of times.

Validation BLEU during training is `bleu_evaluator(config, tokenizer)`: the function the trainer receives, so that
training never imports evaluation (big_vision's evaluators work this way).

Scores (`score_all`): sacreBLEU corpus BLEU, chrF, chrF++ and TER on detokenized text, and the paper-comparable
tokenized BLEU.

sacreBLEU (Post, 2018) scores detokenized output against raw references with its own tokenization and prints a
signature that makes the number reproducible; it is the score to report. Papers of the time (the Transformer
paper, GNMT, ConvS2S) reported BLEU on tokenized text with hyphenated compounds split, following tensor2tensor's
`get_ende_bleu.sh`: Moses-tokenize, rewrite `(\\S)-(\\S)` as `\\1 ##AT##-##AT## \\2`, then multi-bleu.perl. That
number is reproduced here with sacreBLEU's 13a tokenizer in place of the Moses tokenizer (not a dependency of this
project), reported separately and labelled, and never mixed up with sacreBLEU's.

Axis letters: see transformer_jax/__init__.py.
"""

from __future__ import annotations

import dataclasses
import os
import re
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, NamedTuple, Protocol

import ml_collections
import numpy as np
from flax import nnx
from sacrebleu.metrics import BLEU, CHRF, TER
from sacrebleu.tokenizers.tokenizer_13a import Tokenizer13a
from sacrebleu.tokenizers.tokenizer_intl import TokenizerV14International

from transformer_jax import decoding
from transformer_jax.data import languages, sources
from transformer_jax.data.batching import padded_eval_length
from transformer_jax.data.languages import validation_directions
from transformer_jax.data.sources import validation_sets
from transformer_jax.errors import EvalError, ScoreError, UserError
from transformer_jax.model.layers import SpecialIds
from transformer_jax.runtime import Progress


class Tokenizer(Protocol):
    """What translation needs of a tokenizer (data/tokenizer.py's interface)."""

    ids: SpecialIds

    def encode_source(self, text: str) -> list[int]: ...

    def encode_target(self, text: str) -> list[int]: ...

    def decode_target(self, ids: Sequence[int]) -> str: ...


# The rules of what is decoded, shared with every engine that must decode exactly as we do (interop/ctranslate2.py).


def source_ids(
    tokenizer: Tokenizer, sentence: str, max_input_len: int, prefix: Sequence[int] = ()
) -> tuple[list[int] | None, bool]:
    """(ids then EOS, cut to max_input_len - 1 ids + EOS; None for a blank line, which is not decoded), was_cut.
    `prefix` (a language id) comes before the sentence's ids and counts towards max_input_len."""
    if not sentence.strip():
        return None, False
    ids = [*prefix, *tokenizer.encode_source(sentence)]
    cut = len(ids) + 1 > max_input_len
    return (ids[: max_input_len - 1] if cut else ids) + [tokenizer.ids.eos], cut


def sources_of(
    tokenizer: Tokenizer, sentences: Sequence[str], max_input_len: int, prefixes: Sequence[Sequence[int]] | None = None
) -> tuple[dict[int, list[int]], list]:
    """source_ids of every sentence (sentence i after prefixes[i]): {index: ids} of the lines that are decoded (blank
    lines are not), and the 1-based numbers of the lines that were cut."""
    sources, truncated_lines = {}, []
    for i, sentence in enumerate(sentences):
        ids, cut = source_ids(tokenizer, sentence, max_input_len, () if prefixes is None else prefixes[i])
        if ids is not None:
            sources[i] = ids
        if cut:
            truncated_lines.append(i + 1)
    return sources, truncated_lines


def position_limit(spec: Any) -> int | None:
    """The most positions the model can encode or decode: a learned table's rows from model.position_offset on; None
    (no limit) otherwise."""
    return spec.max_len - spec.position_offset if spec.positional == "learned" else None


def input_limit(max_input_len: int, position_limit: int | None) -> int:
    """The most source tokens (EOS included) kept: max_input_len, and no more than a learned table has rows."""
    return max_input_len if position_limit is None else min(max_input_len, position_limit)


def output_cap(max_len: int, position_limit: int | None) -> int | None:
    """The most tokens any output may have, EOS included: eval.max_len (0 = no cap) and no more than a learned
    position table has rows; None = no cap."""
    caps = [cap for cap in (max_len, position_limit) if cap]
    return min(caps) if caps else None


def output_limit(source_len: int, max_extra_len: int, cap: int | None) -> int:
    """The most tokens an output may have, EOS included: source tokens (EOS included) + max_extra_len, at most `cap`
    (output_cap)."""
    limit = source_len + max_extra_len
    return limit if cap is None else min(limit, cap)


def batch_shape(longest: int, max_input_len: int, max_extra_len: int, cap: int | None) -> tuple[int, int]:
    """A batch's padded source length (a few lengths that double, to bound compilations) and its most output slots,
    given its longest source (EOS included)."""
    src_len = padded_eval_length(longest, max_input_len)
    return src_len, output_limit(src_len, max_extra_len, cap)


class Hypothesis(NamedTuple):
    """One output of a sentence's n-best list."""

    text: str  # detokenized, EOS removed
    log_prob: float  # log P(tokens | source), the tokens EOS included when emitted
    score: float  # log_prob / lp(length): what the search ranks by
    length: int  # emitted tokens, EOS included
    ended: bool  # it emitted EOS (False: it stopped at its length limit)


EMPTY = Hypothesis("", 0.0, 0.0, 0, False)  # a blank input line's output (not decoded)


class LanguageIds(NamedTuple):
    """One direction's language tokens for translating (languages.Placement): `source` starts every source's ids,
    `target` is forced as the output's first token (as training teaches it); the tokenizer's decode drops them."""

    source: int | None
    target: int | None

    @classmethod
    def of(cls, placement: languages.Placement, direction: languages.Direction) -> LanguageIds:
        return cls(placement.source_prefix(direction), placement.target_prefix(direction))

    @staticmethod
    def per_line(language_ids: LanguageIds | Sequence[LanguageIds] | None, lines: int) -> list[LanguageIds]:
        """One LanguageIds per line: the same for every line, or each line its own (ValueError for a count that
        differs)."""
        if language_ids is None or isinstance(language_ids, LanguageIds):
            return [language_ids or NO_LANGUAGE] * lines
        if len(language_ids) != lines:
            raise ValueError(f"{lines} sentences but {len(language_ids)} language_ids: give one per sentence")
        return list(language_ids)


NO_LANGUAGE = LanguageIds(None, None)


def language_tokens(tokenizer: Any) -> tuple[int, ...]:
    """The ids of a multilingual tokenizer's language tokens (its languages.Placement), which a search emits only
    where it is forced to; () for a bilingual one."""
    table = getattr(tokenizer, "language_table", None)
    return () if table is None else tuple(sorted(table.ids.values()))


def check_nbest(nbest: int, beam_size: int, flag: str = "--nbest") -> None:
    """EvalError unless 1 <= nbest <= beam_size: an n-best list holds the beams of one search."""
    if not 1 <= nbest <= beam_size:
        raise EvalError(f"{flag} {nbest} must be between 1 and the beam size ({beam_size}); raise --beam_size")


def check_sampling(sampling: decoding.Sampling, num_samples: int) -> None:
    try:
        sampling.check()
    except ValueError as e:
        raise EvalError(str(e)) from None
    if num_samples < 1:
        raise EvalError(f"--num_samples must be >= 1, got {num_samples}")


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """What translate() decodes with: the search (a decoding.Search spec) and the batch and length limits."""

    search: decoding.Search
    max_extra_len: int  # output tokens beyond the source's (EOS included): output_limit
    max_len: int  # output tokens at most, EOS included, whatever the source (0 = no cap): output_cap
    batch_size: int  # sentences decoded together
    max_input_len: int  # source tokens kept, EOS included: input_limit

    def report(self) -> dict[str, Any]:
        return {
            "beam_size": self.search.beam_size,
            "alpha": self.search.alpha,
            "max_extra_len": self.max_extra_len,
            "max_len": self.max_len,
            "batch_size": self.batch_size,
            "max_input_len": self.max_input_len,
        }


def translate(
    model: nnx.Module,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    settings: DecodeSettings,
    *,
    prefixes: Sequence[str] | None = None,
    progress: bool = False,
    language_ids: LanguageIds | Sequence[LanguageIds] | None = None,
) -> tuple[list[str], dict[str, Any]]:
    """One output per input sentence, in order, and statistics (see translate_nbest, of which this is the 1-best)."""
    found, stats = translate_nbest(
        model,
        tokenizer,
        sentences,
        settings,
        nbest=1,
        prefixes=prefixes,
        progress=progress,
        language_ids=language_ids,
    )
    return [hypotheses[0].text for hypotheses in found], stats


def translate_nbest(
    model: nnx.Module,
    tokenizer: Tokenizer,
    sentences: Sequence[str],
    settings: DecodeSettings,
    *,
    nbest: int,
    prefixes: Sequence[str] | None = None,
    progress: bool = False,
    first_line: int = 0,
    language_ids: LanguageIds | Sequence[LanguageIds] | None = None,
) -> tuple[list[list[Hypothesis]], dict[str, Any]]:
    """The `nbest` best hypotheses of each input sentence, best first, in input order, and statistics of the 1-best.

    Sources are cut as `source_ids` cuts them (counted); a blank line gives EMPTY outputs without decoding. The list
    is what the search gives for nbest, or nbest decodes of the line when the search asks for that
    (decoding.Search.copies: sampling's draws, best score first; their log_prob is the model's log P of the sample).
    prefixes: line i's output starts with prefixes[i], tokenized as a target (a blank prefix: none); the hypotheses'
    text and log-probabilities include it. first_line: the number of sentences[0] in a longer input (its chunk's
    start, translate_corpus): sampling keys are drawn from the line's number in the whole input.
    language_ids: a multilingual model's tokens of the direction (LanguageIds), or one LanguageIds per sentence (a
    batch then mixes directions): the source's id starts the source (counted in max_input_len), the target's is
    forced before any prefix: it takes one output slot and counts one in the length, adds 0 to the log-probability,
    and is left out of the text. The search never emits a language token otherwise (decoding/state.py choosable).
    """
    copies = settings.search.copies(nbest)
    check_nbest(nbest, settings.search.beam_size if copies == 1 else nbest)  # n decodes: any n >= 1
    search = settings.search.nbest(1 if copies > 1 else nbest)
    if prefixes is not None and len(prefixes) != len(sentences):
        raise EvalError(f"{len(sentences)} sentences but {len(prefixes)} prefixes: give one prefix per sentence")
    start = time.perf_counter()
    limit = position_limit(model.spec)
    max_input_len = input_limit(settings.max_input_len, limit)
    max_extra_len, cap = settings.max_extra_len, output_cap(settings.max_len, limit)

    outputs = [[EMPTY] * nbest for _ in sentences]
    lang = LanguageIds.per_line(language_ids, len(sentences))
    source_prefixes = [[] if x.source is None else [x.source] for x in lang]
    sources, truncated_lines = sources_of(tokenizer, sentences, max_input_len, source_prefixes)

    stats: dict[str, Any] = {
        "sentences": len(sentences),
        "empty": len(sentences) - len(sources),
        "truncated": len(truncated_lines),
        "truncated_lines": truncated_lines[:100],  # 1-based line numbers, the first 100
        "hit_max_len": 0,
        "src_tokens": int(sum(len(s) for s in sources.values())),
        "tgt_tokens": 0,
        "shapes": set(),
    }

    def shape(longest: int) -> tuple[int, int]:
        found = batch_shape(longest, max_input_len, max_extra_len, cap)
        stats["shapes"].add(found)
        return found

    bar = Progress(len(sources), "translating", "sentences") if progress else None
    # Each line is decoded `copies` times (sampling: its nbest draws), copy j of line i with its own row inputs.
    lines = [i for i in sources for _ in range(copies)]
    row_inputs = search.row_inputs(np.array(lines, np.int64) + first_line, np.tile(np.arange(copies), len(sources)))
    found = decoding.Searcher(model, languages=language_tokens(tokenizer)).sentences(
        [sources[i] for i in lines],
        [output_limit(len(sources[i]), max_extra_len, cap) for i in lines],
        search,
        batch_size=settings.batch_size,
        shape=shape,
        progress=None if bar is None else bar.update,
        prefixes=target_prefixes(tokenizer, lines, prefixes, [x.target for x in lang]),
        row_inputs_N=row_inputs,
    )
    for j in range(0, len(lines), copies):
        i = lines[j]
        if copies == 1:
            outputs[i] = [_hypothesis(tokenizer, found[j], w) for w in range(nbest)]
        else:  # the decodes, best score first
            drawn = [_hypothesis(tokenizer, found[j + k], 0) for k in range(copies)]
            outputs[i] = sorted(drawn, key=lambda h: -h.score)
        stats["hit_max_len"] += not outputs[i][0].ended
        stats["tgt_tokens"] += outputs[i][0].length
    if bar is not None:
        bar.close()
    seconds = time.perf_counter() - start
    stats["shapes"] = sorted(stats["shapes"])
    stats["seconds"] = round(seconds, 3)
    stats["sentences_per_s"] = round(len(sentences) / seconds, 2) if seconds > 0 else None
    return outputs, stats


def target_prefixes(
    tokenizer: Tokenizer, lines: Sequence[int], prefixes: Sequence[str] | None, languages: Sequence[int | None]
) -> list[list[int]] | None:
    """The forced start of each decoded row (line `lines[r]`): its target language's id (languages[line], None:
    none), then the line's prefix tokenized as a target; None when no line has either (the search then runs without
    prefixes)."""
    if prefixes is None and all(x is None for x in languages):
        return None
    head = [[] if x is None else [x] for x in languages]
    return [head[i] + ([] if prefixes is None else list(tokenizer.encode_target(prefixes[i]))) for i in lines]


def _hypothesis(tokenizer: Tokenizer, result: decoding.BeamResult, beam: int) -> Hypothesis:
    """Beam `beam` of one sentence's result, detokenized without EOS and PAD (and language ids: the tokenizer's)."""
    n = int(result.lengths[beam])
    ids = result.tokens[beam, :n].tolist()
    ended = bool(ids) and ids[-1] == tokenizer.ids.eos
    text = tokenizer.decode_target([t for t in ids if t not in (tokenizer.ids.eos, tokenizer.ids.pad)])
    return Hypothesis(text, float(result.log_probs[beam]), float(result.scores[beam]), n, ended)


def validation_settings(config: ml_collections.ConfigDict) -> DecodeSettings:
    """translate()'s settings for validation BLEU: config.eval's search, sources cut at data.eval_max_len."""
    return DecodeSettings(
        search=decoding.search_for(config.eval.beam_size, config.eval.alpha),
        max_extra_len=config.eval.max_extra_len,
        max_len=config.eval.max_len,
        batch_size=config.eval.batch_size,
        max_input_len=config.data.eval_max_len,
    )


def bleu_evaluator(config: ml_collections.ConfigDict, tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """A function of the model (eval mode) -> the scores (score_all) of its translations of the first
    train.bleu_sentences validation pairs: `bleu`, ... for data.valid_split, `NAME_bleu`, ... for each
    eval.extra_valid set. A multilingual run's: see direction_bleu_evaluator."""
    if config.data.directions:
        return direction_bleu_evaluator(config, tokenizer)
    sets = [(name, pairs[: config.train.bleu_sentences]) for name, pairs in validation_sets(config)]
    settings = validation_settings(config)

    def evaluate(model: Any) -> dict[str, float]:
        out = {}
        for name, pairs in sets:
            hypotheses, _ = translate(model, tokenizer, [s for s, _ in pairs], settings)
            scores = score_all(hypotheses, [t for _, t in pairs])
            out.update({f"{name}_{key}" if name else key: float(value["score"]) for key, value in scores.items()})
        return out

    return evaluate


def direction_bleu_evaluator(config: ml_collections.ConfigDict, tokenizer: Any) -> Callable[[Any], dict[str, float]]:
    """bleu_evaluator of a multilingual run (data.directions): the first train.bleu_sentences pairs of each direction
    translated with its language tokens (LanguageIds), scored as `<src>-<tgt>_bleu`, ..., and each score's unweighted
    mean over the directions as `bleu`, ... (what train.select_metric=valid_bleu ranks).

    Cost: directions x train.bleu_sentences translations per validation BLEU (12 directions x 200 = 2,400 sentences
    where a bilingual run decodes 200), in one search call per direction."""
    placement = languages.Placement.of(config)
    sets = [(d, pairs[: config.train.bleu_sentences]) for d, pairs in validation_directions(config)]
    settings = validation_settings(config)

    def evaluate(model: Any) -> dict[str, float]:
        out, per_direction = {}, []
        for d, pairs in sets:
            ids = LanguageIds.of(placement, d)
            hypotheses, _ = translate(model, tokenizer, [s for s, _ in pairs], settings, language_ids=ids)
            scores = {key: float(value["score"]) for key, value in score_all(hypotheses, [t for _, t in pairs]).items()}
            out.update({f"{d.name}_{key}": value for key, value in scores.items()})
            per_direction.append(scores)
        out.update({key: float(np.mean([s[key] for s in per_direction])) for key in per_direction[0]})
        return out

    return evaluate


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


# -- n-best lists in Marian's text format -------------------------------------------------------------------------

SEPARATOR = " ||| "


def nbest_lines(lists: Sequence[Sequence[Hypothesis]]) -> Iterable[str]:
    for i, hypotheses in enumerate(lists):
        for h in hypotheses:
            yield SEPARATOR.join((str(i), h.text, f"F0= {h.log_prob:.6f}", f"{h.score:.6f}"))


def parse_nbest_line(line: str) -> tuple[int, str, float, float]:
    """(input line, hypothesis, log_prob, score) of one line of an n-best file."""
    index, text, features, score = line.rstrip("\n").split(SEPARATOR)
    name, value = features.split()
    if name != "F0=":
        raise ValueError(f"unexpected feature {name!r} in n-best line {line!r}")
    return int(index), text, float(value), float(score)
