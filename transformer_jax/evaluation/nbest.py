"""n-best lists in Marian's text format, which rerankers read.

One line per hypothesis, exactly N per input line (a blank input line gets N empty hypotheses of log-probability 0),
best first:

    i ||| hypothesis ||| F0= log_prob ||| score

i counts input lines from 0; log_prob is the hypothesis's total log-probability log P(Y|X) (EOS included when
emitted) and score, the total the search ranked by, log_prob / lp(|Y|) with the chosen length penalty.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from transformer_jax.evaluation.translate import Hypothesis

SEPARATOR = " ||| "


def nbest_lines(lists: Sequence[Sequence[Hypothesis]]) -> Iterable[str]:
    """The lines of the n-best file for each input line's hypotheses (best first)."""
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
