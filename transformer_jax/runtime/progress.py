"""The one progress display of the package: a tqdm bar on a terminal, plain log lines otherwise (a log file).

Used for training steps (training.metrics), tokenizing a split (data.store) and translating (evaluation.translate).
Log lines come every tenth of the way, and at every update that carries values to show (training logs its loss
each train.log_every steps), with the elapsed time and an estimate of the time left. (clu's metric writers and
periodic actions are not used: clu's last release is from 2024, and this is all the package needs of them.)
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

import tqdm

log = logging.getLogger(__name__)  # the standard logger, which train.py shows at INFO (it quiets absl's)


class Progress:
    """Progress over `total` units (`unit`: steps, lines, sentences) starting at `initial`.

    `update(n, **shown)` advances by n; `set(done, **shown)` moves to an absolute position; `shown` values (loss,
    learning rate, ...) go into the bar's postfix or the log line. `enabled=False` (a host other than process 0)
    shows nothing.
    """

    def __init__(self, total: int, desc: str, unit: str, initial: int = 0, enabled: bool = True):
        self.total, self.desc, self.unit = total, desc, unit
        self.first = self.done = initial
        self.start = time.perf_counter()
        self.enabled = enabled
        self.next_tenth = self._tenths() + 1
        self.bar = None
        if enabled and sys.stderr.isatty():
            self.bar = tqdm.tqdm(
                total=total, initial=initial, desc=desc, unit=f" {unit}", dynamic_ncols=True, mininterval=1.0
            )

    def _tenths(self) -> int:
        return 10 * self.done // self.total if self.total else 0

    def update(self, n: int = 1, **shown: float) -> None:
        self.set(self.done + n, **shown)

    def set(self, done: int, **shown: float) -> None:
        self.done = done
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.n = done
            if shown:
                self.bar.set_postfix({k: f"{v:.3g}" for k, v in shown.items()}, refresh=False)
            self.bar.refresh()
            return
        tenths = self._tenths()
        if shown or tenths >= self.next_tenth:
            self.next_tenth = tenths + 1
            log.info("%s", self.line(shown))

    def line(self, shown: dict[str, float] | None = None) -> str:
        """'desc: done/total unit (p%)  key value ...  elapsed s, eta HH:MM:SS'."""
        elapsed = time.perf_counter() - self.start
        rate = (self.done - self.first) / elapsed if elapsed > 0 else 0.0
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        percent = f" ({100 * self.done // self.total}%)" if self.total else ""
        values = "".join(f"  {k} {v:.4g}" for k, v in (shown or {}).items())
        return (
            f"{self.desc}: {self.done}/{self.total} {self.unit}{percent}{values}  {elapsed:.0f} s, "
            f"eta {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
