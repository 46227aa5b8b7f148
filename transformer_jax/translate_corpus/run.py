"""Translating a corpus as a library: `job_of(values, ...)` checks the flags into a Job, `translate_corpus(job)`
does the work in chunks (chunks.py) and returns the report.

Unlike evaluation.run, this library writes files: the committed chunks are what makes the work resumable, as a
training loop's checkpoints are. It prints nothing (the progress bar, when asked, goes to stderr).

Parallelism: the input's chunks are dealt to the hosts (chunk c to process c mod process_count, one process per
host, as training), and each host's chunks to its local devices: every device holds a copy of the parameters and
decodes whole chunks in `streams` threads (jax releases the GIL while a device computes), each taking the next
chunk when it has finished one. On a CPU, CPU_STREAMS threads are the default: one search's step leaves a core
idle (its attention products and small projections run on one core, and the device waits while the host schedules
between calls), which another search's step then uses (docs/benchmarks.md). A chunk's translation depends on its
lines only (its batches are made from its own lines; sampling keys come from the seed and each line's number in
the whole input), so which device, stream or host made it, and in which order, changes nothing.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from transformer_jax.errors import EvalError
from transformer_jax.evaluation import command
from transformer_jax.evaluation import run as evaluation
from transformer_jax.evaluation.translate import translate_nbest
from transformer_jax.runtime import Progress
from transformer_jax.translate_corpus import chunks

# evaluate.py's flags that translate_corpus reads (one table: evaluation.command.FLAGS); the checkpoint flags too.
DECODING_FLAGS = (
    "beam_size",
    "alpha",
    "max_extra_len",
    "max_len",
    "batch_size",
    "length_penalty",
    "finished",
    "sampling",
    "temperature",
    "top_k",
    "top_p",
    "seed",
    "target_lang",
    "ensemble_workdirs",
)
FLAG_NAMES = (*command.CHECKPOINT_FLAGS, *DECODING_FLAGS)
DEFAULT_CHUNK_LINES = 1000
CPU_STREAMS = 2  # searches at once on a CPU device (streams=0); an accelerator runs one (docs/benchmarks.md)
STREAMS_ZERO = f"0: {CPU_STREAMS} on a CPU, 1 on an accelerator"  # what streams=0 means (streams_per_device)


@dataclasses.dataclass(frozen=True)
class Job:
    """A corpus to translate: evaluate.py's Translate record (its source_file is --input), where the output goes,
    the chunk size, the flags given as the state file records them, and the searches each device runs at once
    (0: CPU_STREAMS on a CPU, else 1; not recorded: it changes no output, only the speed)."""

    mode: command.Translate
    output: str
    chunk_lines: int
    options: dict[str, Any]
    streams: int = 0


def job_of(
    values: Mapping[str, Any], input_file: str | None, output: str | None, chunk_lines: int, streams: int = 0
) -> Job:
    """The Job of translate_corpus's flag values (FLAG_NAMES, absent or None: unset), or EvalError naming the flag.
    Reads no file; checks that the outputs can be written and that none is an input."""
    if not input_file:
        raise EvalError("give --input, the file to translate (one sentence a line)")
    if not output:
        raise EvalError("give --output, the file of translations to write")
    if input_file == "-":
        raise EvalError("--input - (stdin) cannot be resumed: give a file, or use evaluate.py --source_file -")
    if chunk_lines < 1:
        raise EvalError(f"--chunk_lines must be >= 1, got {chunk_lines}")
    if streams < 0:
        raise EvalError(f"--streams must be >= 0 ({STREAMS_ZERO}), got {streams}")
    unknown = set(values) - set(FLAG_NAMES)
    if unknown:
        raise TypeError(f"not translate_corpus flags: {sorted(unknown)}")
    mode, _ = command.parse({**values, "source_file": input_file})
    assert isinstance(mode, command.Translate) and mode.decoding.candidates == 1
    written = {
        "--output": output,
        "--output's scores (OUTPUT.scores)": chunks.scores_file(output),
        "--output's chunks (OUTPUT.parts)": str(chunks.parts_dir(output)),
    }
    for flag, path in written.items():
        if flag.endswith("(OUTPUT.parts)"):
            command.check_folder_writable(path, flag)
        else:
            command.check_writable(path, flag)
    models = {"--workdir": mode.model.workdir}
    models.update({f"--ensemble_workdirs ({w})": w for w in mode.model.ensemble_workdirs or ()})
    command.refuse_overwriting_inputs(written, {"--input": input_file, **models})
    given = {name: _recorded(name, values[name]) for name in FLAG_NAMES if values.get(name) not in (None, False)}
    return Job(mode, output, chunk_lines, given, streams)


def _recorded(name: str, value: Any) -> Any:
    """A flag value as the state file records it: a config by the digest of its JSON, a workdir by its real path
    (a resume may spell it otherwise)."""
    if hasattr(value, "to_json_best_effort"):
        return chunks.fingerprint({"config": value.to_json_best_effort(sort_keys=True)})
    if name in ("workdir", "ensemble_workdirs"):
        return os.path.realpath(value) if name == "workdir" else [os.path.realpath(w) for w in value]
    return list(value) if isinstance(value, tuple | list) else value


def translate_corpus(job: Job, *, progress: bool = False) -> dict[str, Any]:
    """Translates job's input chunk by chunk, resuming from the chunks committed before, and on process 0 writes
    OUTPUT and OUTPUT.scores once every chunk is there; returns the report. EvalError before any work when the
    input or the flags differ from those of the chunks found."""
    start = time.perf_counter()
    source = job.mode.source_file
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EvalError(f"cannot read --input {source}: {e.strerror or e}") from e
    if not data:
        raise EvalError(f"--input {source} is empty: nothing to translate")
    parts = chunks.parts_dir(job.output)
    flag_of = {name: f"--{name}" for name in FLAG_NAMES} | {"chunk_lines": "--chunk_lines"}
    work = {
        "format": chunks.FORMAT,
        "input": chunks.input_identity(source, data),
        "options": job.options,
        "chunk_lines": job.chunk_lines,
    }
    chunks.check_resume(parts, work, flag_of)  # before the model is restored: a wrong resume fails at once
    loaded = evaluation.load(job.mode)  # reads the lines as evaluate.py does (UTF-8, blank lines kept)
    settings, search = evaluation.settings_of(job.mode, loaded)
    work["model"] = {"checkpoint_steps": loaded.steps, "decoding": settings.report(), "search": search}
    flag_of["checkpoint_steps"] = "checkpoint steps (--checkpoint latest moves as training goes on)"
    chunks.check_resume(parts, work, flag_of)
    print_ = chunks.fingerprint(work)
    if jax.process_index() == 0 and chunks.read_state(parts) is None:
        chunks.write_state(parts, work)
    _sync("translate_corpus state")

    sources = loaded.sources
    streams = streams_per_device(job.streams)
    n, size = len(sources), job.chunk_lines
    bounds = [(first, min(first + size, n)) for first in range(0, n, size)]
    mine = [c for c in range(len(bounds)) if c % jax.process_count() == jax.process_index()]
    done, redone = _committed(parts, print_, {c: bounds[c] for c in mine})
    todo = [c for c in mine if c not in done]
    bar = Progress(
        sum(end - first for first, end in (bounds[c] for c in mine)),
        "translating",
        "lines",
        initial=sum(len(c.hypotheses) for c in done.values()),
        enabled=progress and jax.process_index() == 0,
    )
    resumed = len(done)

    def translate_chunk(model: nnx.Module, c: int) -> chunks.Chunk:
        first, end = bounds[c]
        lists, stats = translate_nbest(
            model, loaded.tokenizer, sources[first:end], settings, nbest=1, prefixes=None, first_line=first
        )
        blank = [not line.strip() for line in sources[first:end]]
        best = [x[0] for x in lists]
        return chunks.Chunk(
            first=first,
            hypotheses=[h.text for h in best],
            log_probs=[None if b else h.log_prob for h, b in zip(best, blank, strict=True)],
            scores=[None if b else h.score for h, b in zip(best, blank, strict=True)],
            counts={key: int(stats[key]) for key in chunks.COUNTS},
        )

    def commit(c: int, chunk: chunks.Chunk) -> None:
        chunks.write_chunk(parts, c, chunk, print_)
        done[c] = chunk
        lines = bar.done + len(chunk.hypotheses) - bar.first  # translated by this process so far
        bar.update(len(chunk.hypotheses), **{"lines/s": lines / (time.perf_counter() - bar.start)})

    try:
        _on_devices(device_models(loaded.model, streams), todo, translate_chunk, commit)
    finally:
        bar.close()
    _sync("translate_corpus chunks")
    if jax.process_index() == 0:
        others = {c: bounds[c] for c in range(len(bounds)) if c not in done}  # the other hosts' chunks
        found, damaged = _committed(parts, print_, others)
        if len(found) < len(others):
            missing = sorted(set(others) - set(found))
            raise EvalError(f"chunks {missing} of {parts} are missing or damaged ({damaged}): run again to redo them")
        done.update(found)
        every = [done[c] for c in range(len(bounds))]
        chunks.assemble(job.output, every)
    else:
        every = [done[c] for c in mine]
    seconds = time.perf_counter() - start
    return {
        "input": source,
        "output": job.output,
        "scores_file": chunks.scores_file(job.output),
        "scores_columns": ["log_prob", "score"],
        "lines": n,
        "chunks": len(bounds),
        "chunks_of_this_host": len(mine),
        "chunks_resumed": resumed,
        "chunks_redone": redone,
        "devices": jax.local_device_count(),
        "streams": streams,
        "checkpoint_steps": loaded.steps,
        "decoding": settings.report(),
        "search": search,
        "counts": {key: sum(c.counts[key] for c in every) for key in chunks.COUNTS},
        "seconds": round(seconds, 3),
    }


def _committed(
    parts: Path, print_: str, bounds: dict[int, tuple[int, int]]
) -> tuple[dict[int, chunks.Chunk], list[int]]:
    """The chunks of `bounds` (index: first line, end) committed whole under this work, and those found damaged or
    of other work (to be redone)."""
    done, damaged = {}, []
    for c, (first, end) in bounds.items():
        try:
            done[c] = chunks.read_chunk(parts, c, print_, first, end - first)
        except FileNotFoundError:
            pass
        except ValueError:
            damaged.append(c)
    return done, damaged


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def streams_per_device(streams: int) -> int:
    """The searches each device runs at once: `streams`, or for 0 CPU_STREAMS on a CPU and 1 on an accelerator."""
    return streams or (CPU_STREAMS if jax.default_backend() == "cpu" else 1)


def device_models(model: nnx.Module, streams: int = 1) -> list[nnx.Module]:
    """`streams` models on each local device, one a thread of `_on_devices`: the model itself when that is one,
    else a copy of the parameters on each device, shared by that device's streams."""
    devices = jax.local_devices()
    if len(devices) == 1 and streams == 1:
        return [model]
    graphdef, state = nnx.split(model)
    placed = [state] if len(devices) == 1 else [jax.device_put(state, device) for device in devices]
    return [nnx.merge(graphdef, on_device) for on_device in placed for _ in range(streams)]


def _on_devices(
    models: Sequence[nnx.Module],
    todo: Sequence[int],
    translate_chunk: Callable[[nnx.Module, int], chunks.Chunk],
    commit: Callable[[int, chunks.Chunk], None],
) -> None:
    """Translates the chunks `todo`, each model (one a device) taking the next one when it is free; commits each
    as it is done (one at a time). The first error stops the others after their current chunk and is raised."""
    if len(models) == 1:
        for c in todo:
            commit(c, translate_chunk(models[0], c))
        return
    pending = iter(todo)
    lock = threading.Lock()
    failed = threading.Event()

    def work(model: nnx.Module) -> None:
        while not failed.is_set():
            with lock:
                c = next(pending, None)
            if c is None:
                return
            try:
                chunk = translate_chunk(model, c)
                with lock:
                    commit(c, chunk)
            except BaseException:
                failed.set()
                raise

    with concurrent.futures.ThreadPoolExecutor(len(models)) as pool:
        futures = [pool.submit(work, model) for model in models]
        for future in futures:
            future.result()
