"""Where translate_corpus's steady state spends its time on the device: a `jax.profiler` trace, summarised as JSON.

    python -m benchmarks.profile_decode --workdir W --input FILE [--lines 1000] [--beam_size 1] [--trace_dir DIR]

Translates the first --lines lines of FILE three times in one process with the library translate_corpus calls
(`translate_corpus.run`): once to compile, once timed without the profiler, once under `jax.profiler.trace` (Python
tracing off: it would cost more than the decode). The same programs run in the last two, so the trace holds no
compilation. From the trace's XLA:CPU threads: the window from the first operation to the last, the wall time
during which some operation ran (the union of their intervals; the rest of the window the host was deciding or
dispatching), each operation's self time (its children's time subtracted) summed by kind, and the ten largest.
`profiled_s` against `unprofiled_s` shows what tracing cost. The untraced run also counts the time the host spent
blocked in `jax.device_get` (waiting for the device's results: the scheduler reads each stage's outcome that way);
the rest of it, `unprofiled_host_s`, is the host's own work, during which nothing else keeps the device busy:
restoring the model (each translate_corpus call restores it), then scheduling, dispatching, tokenising, writing.
"""

from __future__ import annotations

import collections
import contextlib
import json
import pathlib
import tempfile
import time

import jax
from absl import flags

from transformer_jax import cli
from transformer_jax.translate_corpus import run

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained workdir.", required=True)
_INPUT = flags.DEFINE_string("input", None, "The corpus (one sentence a line).", required=True)
_LINES = flags.DEFINE_integer("lines", 1000, "Its first N lines.")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 1, "Beam size (1: greedy).")
_AVERAGE_LAST = flags.DEFINE_integer("average_last", 1, "Checkpoints to average.")
_TRACE_DIR = flags.DEFINE_string("trace_dir", None, "Keep the trace here (TensorBoard's profile plugin reads it).")

XLA_THREADS = "tf_XLA"  # the XLA:CPU client's and intra-op pool's threads
# Events on those threads that are not an operation's work: program executions (their operations nest in them), the
# client's wait for them, host copies, the pool's bookkeeping, and loops (their bodies' operations are counted).
NOT_OPERATIONS = ("ThunkExecutor::Execute", "H2D Dispatch", "SlinkyThreadPool::Await", "ThreadpoolListener", "while")
MATMUL_KINDS = ("ynn_fusion", "dot")  # YNNPACK's fused matmuls and XLA's own dots


def _union_s(intervals: list[tuple[int, int]]) -> float:
    total, end = 0, None
    start = None
    for s, e in sorted(intervals):
        if end is None or s > end:
            if end is not None:
                total += end - start
            start, end = s, e
        else:
            end = max(end, e)
    if end is not None:
        total += end - start
    return total / 1e9


def summarise(xplane: pathlib.Path) -> dict:
    """The trace's XLA operations: the window they span, the time some operation ran, self time by kind (summed
    over threads: an operation split across the pool counts on each), the largest operations."""
    data = jax.profiler.ProfileData.from_file(str(xplane))
    plane = next(p for p in data.planes if p.name == "/host:CPU")
    busy = []
    self_ns: collections.Counter = collections.Counter()
    calls: collections.Counter = collections.Counter()
    for line in plane.lines:
        if not line.name.startswith(XLA_THREADS):
            continue
        stack: list[list] = []  # [end, name, children's time, duration]

        def close(stack=stack) -> None:
            end, name, children, duration = stack.pop()
            self_ns[name] += duration - children

        events = sorted(((e.start_ns, e.duration_ns, e.name) for e in line.events), key=lambda x: (x[0], -x[1]))
        for start, duration, name in events:
            if name.startswith("end: "):
                continue
            if name.startswith(NOT_OPERATIONS):
                continue
            busy.append((start, start + duration))
            while stack and stack[-1][0] <= start:
                close()
            if stack:
                stack[-1][2] += duration
            stack.append([start + duration, name, 0, duration])
            calls[name] += 1
        while stack:
            close()
    by_kind: collections.Counter = collections.Counter()
    for name, ns in self_ns.items():
        by_kind["matmul" if name.startswith(MATMUL_KINDS) else "other"] += ns
    window = (min(s for s, _ in busy), max(e for _, e in busy)) if busy else (0, 0)
    # Seconds to the microsecond: rounded to the millisecond, a short trace's operations summed to 0.
    return {
        "window_s": round((window[1] - window[0]) / 1e9, 6),  # from the first operation's start to the last's end
        "some_operation_running_s": round(_union_s(busy), 6),
        "self_s_by_kind": {k: round(v / 1e9, 6) for k, v in by_kind.items()},
        "largest": [
            {
                "op": name,
                "self_s": round(ns / 1e9, 6),
                "calls": calls[name],
                "us_each": round(ns / 1e3 / calls[name], 1),
            }
            for name, ns in self_ns.most_common(10)
        ],
    }


@contextlib.contextmanager
def device_get_waits():
    """Within the block, jax.device_get is timed: yields [seconds, calls], filled in as it is called."""
    spent = [0.0, 0]
    device_get = jax.device_get

    def timed(x):
        start = time.perf_counter()
        try:
            return device_get(x)
        finally:
            spent[0] += time.perf_counter() - start
            spent[1] += 1

    jax.device_get = timed
    try:
        yield spent
    finally:
        jax.device_get = device_get


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    with tempfile.TemporaryDirectory() as tmp:
        source = pathlib.Path(tmp, "source.txt")
        with open(_INPUT.value, encoding="utf-8") as f:
            source.write_text("".join(line for _, line in zip(range(_LINES.value), f, strict=False)), encoding="utf-8")
        values = {"workdir": _WORKDIR.value, "average_last": _AVERAGE_LAST.value, "beam_size": _BEAM_SIZE.value}

        def translate(name: str) -> float:
            # One search at a time: the trace is of one search's steps.
            job = run.job_of(values, str(source), str(pathlib.Path(tmp, name)), run.DEFAULT_CHUNK_LINES, streams=1)
            start = time.perf_counter()
            run.translate_corpus(job)
            return time.perf_counter() - start

        first = translate("compile")
        with device_get_waits() as waits:
            unprofiled = translate("unprofiled")
        trace_dir = _TRACE_DIR.value or str(pathlib.Path(tmp, "trace"))
        profile = jax.profiler.ProfileOptions()
        profile.python_tracer_level = 0
        with jax.profiler.trace(trace_dir, profiler_options=profile):
            profiled = translate("profiled")
        xplane = max(pathlib.Path(trace_dir).rglob("*.xplane.pb"), key=lambda p: p.stat().st_mtime)
        report = {
            "workdir": _WORKDIR.value,
            "lines": _LINES.value,
            "beam_size": _BEAM_SIZE.value,
            "first_s": round(first, 2),
            "unprofiled_s": round(unprofiled, 2),
            "unprofiled_waiting_s": round(waits[0], 3),
            "unprofiled_device_gets": waits[1],
            "unprofiled_host_s": round(unprofiled - waits[0], 3),
            "profiled_s": round(profiled, 2),
            **summarise(xplane),
        }
    print(json.dumps(report))


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.profile_decode")
