"""Minimum Bayes risk decoding (Freitag et al., 2022): among N candidates of a line (an n-best list or samples),
choose the one with the highest expected utility, the other candidates standing in for references drawn from the
model:

    argmax_i  1/(N-1) sum_{j != i} u(h_i, h_j)

with u sacrebleu's sentence BLEU or chrF. A candidate scored against itself would add the same maximum to every
candidate, so it is left out. Ties go to the earlier candidate (the better-ranked one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from sacrebleu.metrics import BLEU, CHRF

UTILITIES = ("bleu", "chrf")


def utility(name: str) -> Callable[[str, str], float]:
    """u(hypothesis, reference) by name: sentence BLEU (effective order, so short sentences are not all 0) or chrF."""
    if name == "bleu":
        metric = BLEU(effective_order=True)
    elif name == "chrf":
        metric = CHRF()
    else:
        raise ValueError(f"unknown MBR utility {name!r}; expected one of {', '.join(UTILITIES)}")
    return lambda hypothesis, reference: metric.sentence_score(hypothesis, [reference]).score


def expected_utilities(candidates: Sequence[str], u: Callable[[str, str], float]) -> list[float]:
    """Each candidate's mean utility against the others (a single candidate: 0)."""
    n = len(candidates)
    if n < 2:
        return [0.0] * n
    return [sum(u(h, r) for j, r in enumerate(candidates) if j != i) / (n - 1) for i, h in enumerate(candidates)]


def mbr_choice(candidates: Sequence[str], u: Callable[[str, str], float]) -> int:
    """The index of the candidate with the highest expected utility (the first of equals)."""
    scores = expected_utilities(candidates, u)
    return max(range(len(candidates)), key=lambda i: (scores[i], -i))
