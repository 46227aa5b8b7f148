"""Which validation was best, and whether to stop: the record the trainer keeps for train.select_metric.

The record travels with every checkpoint (in its `data` item, beside the iterator position), so a restart
continues the count of validations without improvement, and a run that stopped early knows it has stopped. The
checkpoints themselves are ranked by Orbax (training.checkpoints: the scores saved beside each checkpoint, a BestN
preservation policy); this record only holds what early stopping needs.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import ml_collections

# The select metrics for which lower is better (a loss, an edit rate); every other one is a score.
LOWER_IS_BETTER = frozenset({"valid_loss", "valid_ter"})
# The select metrics that need the validation sentences decoded (the rest need only the loss).
DECODED = frozenset({"valid_bleu", "valid_chrf", "valid_chrfpp", "valid_ter"})


def is_tracked(config: ml_collections.ConfigDict) -> bool:
    """Whether the run ranks its validations: it keeps best checkpoints or stops early."""
    return bool(config.ckpt.keep_best or config.train.early_stop_patience)


def worst(metric: str) -> float:
    """The score below every real one, for a checkpoint saved without `metric`."""
    return math.inf if metric in LOWER_IS_BETTER else -math.inf


def rank(metrics: dict[str, Any], metric: str) -> float:
    """A saved checkpoint's score for ranking: `metric`'s value, or worst(metric) where it is missing or NaN (a NaN
    would make any sort of the scores arbitrary, and Orbax's BestN sorts them to choose what it deletes)."""
    score = float(metrics.get(metric, worst(metric)))
    return worst(metric) if math.isnan(score) else score


def better(metric: str, score: float, than: float | None) -> bool:
    """Whether `score` improves on `than` (None: nothing yet)."""
    if than is None:
        return not math.isnan(score)
    return score < than if metric in LOWER_IS_BETTER else score > than


@dataclasses.dataclass
class Record:
    """The best validation so far and the validations since it; `stopped_at` once early stopping has fired, with
    the train.num_steps and patience it fired under (raising either lets a restart train on)."""

    metric: str
    best_step: int | None = None
    best_score: float | None = None
    since_best: int = 0
    stopped_at: int | None = None
    stopped_num_steps: int | None = None
    stopped_patience: int | None = None

    def update(self, step: int, score: float) -> bool:
        """Counts one validation; True if it improved the best."""
        if better(self.metric, score, self.best_score):
            self.best_step, self.best_score, self.since_best = step, score, 0
            return True
        self.since_best += 1
        return False

    def exhausted(self, patience: int) -> bool:
        return bool(patience) and self.since_best >= patience

    def stop(self, step: int, config: ml_collections.ConfigDict) -> None:
        self.stopped_at = step
        self.stopped_num_steps, self.stopped_patience = config.train.num_steps, config.train.early_stop_patience

    def still_stopped(self, config: ml_collections.ConfigDict) -> bool:
        """Whether a restart with `config` must not train: the run stopped early and neither train.num_steps nor
        the patience was raised since. Raising num_steps starts the patience afresh."""
        if self.stopped_at is None:
            return False
        if config.train.num_steps > self.stopped_num_steps:
            self.since_best, self.stopped_at = 0, None
            return False
        if config.train.early_stop_patience > self.stopped_patience or not config.train.early_stop_patience:
            self.stopped_at = None
            return False
        return True

    def describe(self) -> str:
        if self.best_step is None:
            return f"no validation scored {self.metric} yet"
        return f"the best step is {self.best_step} with {self.metric}={self.best_score:.4f}"

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, saved: dict[str, Any] | None, metric: str) -> Record:
        """The saved record; a fresh one if there is none or it ranked another metric (its best means nothing
        for this one)."""
        if not saved or saved.get("metric") != metric:
            return cls(metric)
        return cls(**{f.name: saved.get(f.name, f.default) for f in dataclasses.fields(cls)})
