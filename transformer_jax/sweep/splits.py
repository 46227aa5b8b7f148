"""The split a sweep reports (--split valid|test), and every name that follows from it, in this one place: the
files a run keeps of its translation of that split, the results files, and the score columns.

Every finished run is decoded on the validation split; `--split test` decodes it on the test split as well and
reports that. The perplexity column is always the last validation perplexity of training (the test split has none),
and published reference numbers are validation numbers, so only the validation results compare with them.
"""

from __future__ import annotations

import dataclasses

PERPLEXITY = "valid_perplexity"  # from training's last validation: the same column whichever split is reported
SCORE_KEYS = ("bleu", "chrf", "chrfpp", "ter")  # keys of evaluate.py's report; ter is lower-better, the rest higher
TIMING = ("tokens_per_s", "wall_s")


@dataclasses.dataclass(frozen=True)
class Split:
    """A split of the config's data (evaluate.py's --split) as a sweep decodes and reports it."""

    name: str  # "valid" or "test"
    description: str  # in messages and results.md: "the validation split"

    @property
    def hypotheses_file(self) -> str:
        """A finished run's translation of the whole split, in its run directory."""
        return f"{self.name}.hyp"

    @property
    def scores_file(self) -> str:
        """evaluate.py's report on the hypotheses; written last, so its presence means decoded."""
        return f"{self.name}_scores.json"

    @property
    def results_name(self) -> str:
        """DIR/<results_name>.csv, .md and .png."""
        return "results" if self.name == "valid" else f"results_{self.name}"

    @property
    def scores(self) -> dict[str, str]:
        """Results column -> key of the scores report."""
        return {f"{self.name}_{key}": key for key in SCORE_KEYS}

    @property
    def metrics(self) -> tuple[str, ...]:
        """The columns averaged over seeds."""
        return (PERPLEXITY, *self.scores, *TIMING)

    @property
    def delta_metrics(self) -> tuple[str, ...]:
        """The columns compared with the first variant, with an interval over seeds."""
        return (PERPLEXITY, f"{self.name}_bleu", f"{self.name}_chrf")

    @property
    def published(self) -> bool:
        """Whether the config's published reference numbers (validation numbers) apply to this split's results."""
        return self.name == "valid"

    @property
    def decodes(self) -> tuple[Split, ...]:
        """The splits a run is decoded on for these results: always validation, then this one."""
        return (VALID,) if self == VALID else (VALID, self)  # ==: a job gets an unpickled copy


VALID = Split("valid", "validation")
TEST = Split("test", "test")
SPLITS = {s.name: s for s in (VALID, TEST)}
