"""Translating a corpus as a library: `job_of(values, ...)` checks the flags into a Job, `translate_corpus(job)`
does the work in chunks and returns the report.

Unlike evaluation.run, this library writes files: the committed chunks are what makes the work resumable, as a
training loop's checkpoints are. It prints nothing (the progress bar, when asked, goes to stderr).

Parallelism: chunk c goes to process c mod process_count (one process per host), and each host's chunks to its
local devices, each with a copy of the parameters, decoding in `streams` threads (jax releases the GIL while a device
computes). On a CPU, CPU_STREAMS threads are the default: one search's step leaves a core idle, which another
search's step then uses (docs/benchmarks.md). A chunk's translation depends on its lines only (sampling keys come
from the seed and each line's number in the whole input), so which device, stream or host made it changes nothing.
With engine ctranslate2, the restored model is exported once into OUT.parts/ctranslate2 and one CTranslate2
translator per host decodes its chunks (interop/ctranslate2.py ctranslate2_hypotheses: our sources, limits, language
tokens and length penalty), as greedy as ours: what it would decode otherwise than ours is refused before any work.

The chunk store: OUT.parts/ holds a state file and one file per committed chunk.

    OUT.parts/state.json       what the work is: the input (path, size, SHA-256), the flags given, the chunk size,
                               and once the model is restored its checkpoint steps and resolved decoding settings
    OUT.parts/0000003.json     chunk 3: lines [3 N, 4 N) of the input, translated (hypotheses, scores, counts)

Every file is written whole or not at all (runtime.write_text_atomically), and each chunk carries the
fingerprint of the state it was made under, its first line and its line count: a chunk that does not parse or does
not match (a file truncated by a crash of the filesystem, or one left by other work) is redone, never used. A resume
whose input or options differ from the state's is refused in one line, so a finished OUT is always one run's work.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import shutil
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
from flax import nnx
from jax.experimental import multihost_utils

from transformer_jax import runtime
from transformer_jax.decoding.specs import SET_ASIDE
from transformer_jax.decoding.state import AVERAGE
from transformer_jax.errors import DiskFullError, EvalError
from transformer_jax.evaluation import command
from transformer_jax.evaluation import run as evaluation
from transformer_jax.evaluation.translate import DecodeSettings, position_limit, translate_nbest
from transformer_jax.interop import ctranslate2
from transformer_jax.runtime import Progress

# evaluate.py's flags that translate_corpus reads (one table: evaluation.command.FLAGS); the checkpoint flags too.
_SEARCH = ("beam_size", "alpha", "max_extra_len", "max_len", "batch_size", "length_penalty", "finished")
_SAMPLING = ("sampling", "temperature", "top_k", "top_p", "seed")
DECODING_FLAGS = (*_SEARCH, *_SAMPLING, "target_lang", "source_lang", "ensemble_workdirs")
FLAG_NAMES = (*command.CHECKPOINT_FLAGS, *DECODING_FLAGS)
DEFAULT_CHUNK_LINES = 1000
CPU_STREAMS = 2  # searches at once on a CPU device (streams=0); an accelerator runs one (docs/benchmarks.md)
STREAMS_ZERO = f"0: {CPU_STREAMS} on a CPU, 1 on an accelerator"  # what streams=0 means (streams_per_device)
JAX, CTRANSLATE2 = "jax", "ctranslate2"
ENGINES = (JAX, CTRANSLATE2)  # what decodes the chunks: our search, or CTranslate2 on an export of the same weights
EXPORT = "ctranslate2"  # --engine ctranslate2's export, in OUT.parts/
# What CTranslate2 cannot do, as the flags that ask for it (values: what to do instead).
NOT_CTRANSLATE2 = {
    "sampling": "sampling keys come from --seed and each line's number in our search: use --engine jax",
    "ensemble_workdirs": "it decodes one model: use --engine jax to ensemble",
    "streams": "it runs one translator with threads of its own: drop --streams",
}


@dataclasses.dataclass(frozen=True)
class Job:
    """A corpus to translate: evaluate.py's Translate record (its source_file is --input) and where the output goes."""

    mode: evaluation.Translate
    output: str
    chunk_lines: int
    options: dict[str, Any]  # the flags given, as the state file records them
    streams: int = 0  # searches per device at once (0: streams_per_device); not recorded: it changes only the speed
    engine: str = JAX  # ENGINES; recorded when not jax (a resume with the other engine is refused)


def job_of(
    values: Mapping[str, Any],
    input_file: str | None,
    output: str | None,
    chunk_lines: int,
    streams: int = 0,
    engine: str = JAX,
) -> Job:
    """The Job of translate_corpus's flag values (FLAG_NAMES, absent or None: unset), or EvalError naming the flag.
    Reads no file."""
    if engine not in ENGINES:
        raise EvalError(f"--engine {engine!r}: choose one of {list(ENGINES)}")
    if engine == CTRANSLATE2:
        check_ctranslate2({**values, "streams": streams})
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
    assert isinstance(mode, evaluation.Translate) and mode.decoding.candidates == 1
    written = {
        "--output": output,
        "--output's scores (OUTPUT.scores)": scores_file(output),
        "--output's chunks (OUTPUT.parts)": str(parts_dir(output)),
    }
    for flag, path in written.items():
        if flag.endswith("(OUTPUT.parts)"):
            runtime.check_folder_writable(path, flag)
        else:
            runtime.check_writable(path, flag)
    models = {"--workdir": mode.model.workdir}
    models.update({f"--ensemble_workdirs ({w})": w for w in mode.model.ensemble_workdirs or ()})
    runtime.refuse_overwriting_inputs(written, {"--input": input_file, **models})
    given = {name: _recorded(name, values[name]) for name in FLAG_NAMES if values.get(name) not in (None, False)}
    if engine != JAX:
        given["engine"] = engine
    return Job(mode, output, chunk_lines, given, streams, engine)


def check_ctranslate2(values: Mapping[str, Any]) -> None:
    """EvalError naming the first flag CTranslate2 cannot serve (NOT_CTRANSLATE2), or an engine not installed."""
    for name, instead in NOT_CTRANSLATE2.items():
        if values.get(name) not in (None, False, 0, ()):
            raise EvalError(f"--engine ctranslate2 cannot take --{name}: {instead}")
    try:
        import ctranslate2 as engine  # noqa: F401 - only to fail before the model is restored
    except ImportError as e:
        raise EvalError(f"--engine ctranslate2 needs ctranslate2 ({e}): pip install ctranslate2==4.8.5") from e


def check_ctranslate2_search(settings: DecodeSettings, search: Mapping[str, Any], forced_language: bool) -> None:
    """EvalError unless CTranslate2's search is ours: greedy, or beam search with the length penalty `average` and
    finished hypotheses set aside (its rules; tests/test_decoding_ctranslate2.py) and no forced target language
    token (`forced_language`), whose log-probability its scores count and ours do not."""
    beam = settings.search.beam_size
    if beam > 1 and (search["length_penalty"], search["finished"]) != (AVERAGE, SET_ASIDE):
        raise EvalError(
            f"--engine ctranslate2 with --beam_size {beam} ranks by its own rules: give --length_penalty average "
            f"--finished set_aside (its rules) or --beam_size 1 (got {search['length_penalty']}, {search['finished']})"
        )
    if beam > 1 and forced_language:
        raise EvalError(
            f"--engine ctranslate2 with --beam_size {beam}: its beam search counts the forced target language "
            "token's log-probability in every score (ours adds 0), so it ranks otherwise; give --beam_size 1"
        )


def _recorded(name: str, value: Any) -> Any:
    """A flag value as the state file records it: a config by the digest of its JSON, a workdir by its real path
    (a resume may spell it otherwise)."""
    if hasattr(value, "to_json_best_effort"):
        return fingerprint({"config": value.to_json_best_effort(sort_keys=True)})
    if name in ("workdir", "ensemble_workdirs"):
        return os.path.realpath(value) if name == "workdir" else [os.path.realpath(w) for w in value]
    return list(value) if isinstance(value, tuple | list) else value


def translate_corpus(job: Job, *, progress: bool = False) -> dict[str, Any]:
    """Translates job's input chunk by chunk, resuming from the chunks committed before, and on process 0 writes
    OUTPUT and OUTPUT.scores once every chunk is there; returns the report."""
    start = time.perf_counter()
    source = job.mode.source_file
    try:
        with open(source, "rb") as f:
            data = f.read()
    except OSError as e:
        raise EvalError(f"cannot read --input {source}: {e.strerror or e}") from e
    if not data:
        raise EvalError(f"--input {source} is empty: nothing to translate")
    parts = parts_dir(job.output)
    flag_of = {name: f"--{name}" for name in (*FLAG_NAMES, "chunk_lines", "engine")}
    work = {
        "format": FORMAT,
        "input": input_identity(source, data),
        "options": job.options,
        "chunk_lines": job.chunk_lines,
    }
    check_resume(parts, work, flag_of)  # before the model is restored: a wrong resume fails at once
    loaded = evaluation.load(job.mode)  # reads the lines as evaluate.py does (UTF-8, blank lines kept)
    settings, search = evaluation.settings_of(job.mode, loaded)
    if job.engine == CTRANSLATE2:
        check_ctranslate2_search(settings, search, getattr(loaded.language_ids, "target", None) is not None)
    work["model"] = {"checkpoint_steps": loaded.steps, "decoding": settings.report(), "search": search}
    flag_of["checkpoint_steps"] = "checkpoint steps (--checkpoint latest moves as training goes on)"
    check_resume(parts, work, flag_of)
    print_ = fingerprint(work)
    if jax.process_index() == 0 and read_state(parts) is None:
        write_state(parts, work)
    _sync("translate_corpus state")

    sources = loaded.sources
    streams = 1 if job.engine == CTRANSLATE2 else streams_per_device(job.streams)
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

    def translate_chunk(model: Any, c: int) -> Chunk:
        first, end = bounds[c]
        if job.engine == CTRANSLATE2:  # `model`: a ctranslate2.Translator of the export
            best, stats = ctranslate2.ctranslate2_hypotheses(
                model,
                loaded.tokenizer,
                sources[first:end],
                settings,
                position_limit=position_limit(loaded.model.spec),
                language_ids=loaded.language_ids,
            )
        else:
            lists, stats = translate_nbest(
                model,
                loaded.tokenizer,
                sources[first:end],
                settings,
                nbest=1,
                prefixes=None,
                first_line=first,
                language_ids=loaded.language_ids,
            )
            best = [x[0] for x in lists]
        blank = [not line.strip() for line in sources[first:end]]
        return Chunk(
            first=first,
            hypotheses=[h.text for h in best],
            log_probs=[None if b else h.log_prob for h, b in zip(best, blank, strict=True)],
            scores=[None if b else h.score for h, b in zip(best, blank, strict=True)],
            counts={key: int(stats[key]) for key in COUNTS},
        )

    def commit(c: int, chunk: Chunk) -> None:
        write_chunk(parts, c, chunk, print_)
        done[c] = chunk
        lines = bar.done + len(chunk.hypotheses) - bar.first  # translated by this process so far
        bar.update(len(chunk.hypotheses), **{"lines/s": lines / (time.perf_counter() - bar.start)})

    if job.engine == CTRANSLATE2:
        workers = [exported_translator(parts, loaded, settings)]  # every host: it syncs
    else:
        workers = device_models(loaded.model, streams)
    try:
        _on_devices(workers, todo, translate_chunk, commit)
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
        assemble(job.output, every)
    else:
        every = [done[c] for c in mine]
    seconds = time.perf_counter() - start
    return {
        "input": source,
        "output": job.output,
        "scores_file": scores_file(job.output),
        "scores_columns": ["log_prob", "score"],
        "lines": n,
        "chunks": len(bounds),
        "chunks_of_this_host": len(mine),
        "chunks_resumed": resumed,
        "chunks_redone": redone,
        "engine": job.engine,
        "devices": jax.local_device_count(),
        "streams": streams,
        "checkpoint_steps": loaded.steps,
        "decoding": settings.report(),
        "search": search,
        "counts": {key: sum(c.counts[key] for c in every) for key in COUNTS},
        "seconds": round(seconds, 3),
    }


def exported_translator(parts: Path, loaded: evaluation.Loaded, settings: DecodeSettings) -> Any:
    """A ctranslate2.Translator of the restored model, exported once into OUT.parts/EXPORT (by process 0; a resume
    reuses it: its checkpoints and settings are the state's), with positions for the longest decode."""
    import ctranslate2 as engine

    export = parts / EXPORT
    if jax.process_index() == 0 and not (export / ctranslate2.MARKER).is_file():
        positions = max(ctranslate2.ENGINE_DEFAULT_POSITIONS, settings.max_input_len + settings.max_extra_len)
        ctranslate2.to_ctranslate2(loaded.model, loaded.tokenizer, export, max_positions=positions)
    _sync("translate_corpus export")
    return engine.Translator(str(export), device="auto")


def _committed(parts: Path, print_: str, bounds: dict[int, tuple[int, int]]) -> tuple[dict[int, Chunk], list[int]]:
    """The chunks of `bounds` (index: first line, end) committed whole under this work, and those to be redone."""
    done, damaged = {}, []
    for c, (first, end) in bounds.items():
        try:
            done[c] = read_chunk(parts, c, print_, first, end - first)
        except FileNotFoundError:
            pass
        except ValueError:
            damaged.append(c)
    return done, damaged


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def streams_per_device(streams: int) -> int:
    return streams or (CPU_STREAMS if jax.default_backend() == "cpu" else 1)


def device_models(model: nnx.Module, streams: int = 1) -> list[nnx.Module]:
    """`streams` models on each local device, one a thread of `_on_devices`, sharing that device's parameters."""
    devices = jax.local_devices()
    if len(devices) == 1 and streams == 1:
        return [model]
    graphdef, state = nnx.split(model)
    placed = [state] if len(devices) == 1 else [jax.device_put(state, device) for device in devices]
    return [nnx.merge(graphdef, on_device) for on_device in placed for _ in range(streams)]


def _on_devices(
    models: Sequence[nnx.Module],
    todo: Sequence[int],
    translate_chunk: Callable[[nnx.Module, int], Chunk],
    commit: Callable[[int, Chunk], None],
) -> None:
    """Translates the chunks `todo`, each model taking the next one when it is free, and commits each (one at a
    time). The first error stops the others after their current chunk and is raised."""
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


# -- the chunk store (module docstring) ------------------------------------------------------------------------


FORMAT = 1  # the layout of the files below; a store of another format is refused
STATE = "state.json"
COUNTS = ("empty", "truncated", "hit_max_len")  # per-chunk counts of translate_nbest's statistics


def parts_dir(output: str) -> Path:
    return Path(f"{output}.parts")


def scores_file(output: str) -> str:
    return f"{output}.scores"


def input_identity(path: str, data: bytes) -> dict[str, Any]:
    return {"path": os.path.realpath(path), "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def fingerprint(state: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(state, sort_keys=True).encode()).hexdigest()[:16]


def check_resume(parts: Path, work: dict[str, Any], flag_of: dict[str, str]) -> None:
    """EvalError when `parts` holds a state whose input or options differ from `work`'s: resuming would mix two
    runs' translations. `flag_of`: the flag each option came from."""
    state = read_state(parts)
    if state is None:
        return
    if state.get("format") != FORMAT:
        raise EvalError(f"{parts / STATE} is of another format: delete {parts} to start over")
    if state.get("input") != work["input"]:
        raise EvalError(
            f"--input {work['input']['path']} differs from the file {parts} was started on ({state['input']}): "
            f"translate it to another --output, or delete {parts} to start over"
        )
    for section in ("options", "chunk_lines", "model"):
        if section not in work:
            continue
        was, now = state.get(section), work[section]
        if was == now:
            continue
        if isinstance(now, dict) and isinstance(was, dict):
            keys = sorted(k for k in {*was, *now} if was.get(k) != now.get(k))
            named = ", ".join(f"{flag_of.get(k, k)} {was.get(k)!r} -> {now.get(k)!r}" for k in keys)
        else:
            named = f"{flag_of.get(section, section)} {was!r} -> {now!r}"
        raise EvalError(
            f"{parts} was started with other settings ({named}): resume with the same ones, or delete {parts} to "
            "start over"
        )


def read_state(parts: Path) -> dict[str, Any] | None:
    path = parts / STATE
    if not path.exists():
        return None
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot read {path} ({e}): delete {parts} to start over") from None


def write_state(parts: Path, state: dict[str, Any]) -> None:
    runtime.write_text_atomically(parts / STATE, json.dumps(state, sort_keys=True, indent=1) + "\n")


@dataclasses.dataclass(frozen=True)
class Chunk:
    """One chunk's translations: the lines from `first`, each line's hypothesis and scores (None: a blank source)."""

    first: int
    hypotheses: list[str]
    log_probs: list[float | None]
    scores: list[float | None]
    counts: dict[str, int]


def chunk_path(parts: Path, index: int) -> Path:
    return parts / f"{index:07d}.json"


def write_chunk(parts: Path, index: int, chunk: Chunk, print_: str) -> None:
    """Commits chunk `index` (made under the state of fingerprint `print_`) whole or not at all."""
    record = {"fingerprint": print_, **dataclasses.asdict(chunk)}
    path = chunk_path(parts, index)
    try:
        runtime.write_text_atomically(path, json.dumps(record, ensure_ascii=False) + "\n")
    except OSError as e:
        if not runtime.is_disk_full(e):
            raise
        raise DiskFullError(
            f"disk full while committing {path} ({runtime.space_report(path)}); the chunks committed before it are "
            "kept: free space and run the same command again to resume"
        ) from None


def read_chunk(parts: Path, index: int, print_: str, first: int, lines: int) -> Chunk:
    """Chunk `index` if it is committed, whole and of this work (fingerprint, first line, line count); else
    FileNotFoundError when it was never committed, ValueError when it is there but unusable."""
    text = chunk_path(parts, index).read_text(encoding="utf-8")
    record = json.loads(text)  # ValueError for a truncated or damaged file
    if not isinstance(record, dict) or record.pop("fingerprint", None) != print_:
        raise ValueError("made under other settings")
    try:
        chunk = Chunk(**record)
    except TypeError as e:  # other fields: another format's file
        raise ValueError(str(e)) from None
    if chunk.first != first or not len(chunk.hypotheses) == len(chunk.log_probs) == len(chunk.scores) == lines:
        raise ValueError(f"holds other lines than [{first}, {first + lines})")
    return chunk


def assemble(output: str, chunks: list[Chunk]) -> None:
    """Writes OUT and OUT.scores from the chunks in order, each whole or not at all, then removes OUT.parts."""
    hypotheses = [h for c in chunks for h in c.hypotheses]
    rows = [(lp, s) for c in chunks for lp, s in zip(c.log_probs, c.scores, strict=True)]
    runtime.write_lines(scores_file(output), [f"{_number(lp)}\t{_number(s)}" for lp, s in rows])
    runtime.write_lines(output, hypotheses)
    shutil.rmtree(parts_dir(output))


def _number(x: float | None) -> str:
    return "nan" if x is None else repr(float(x))
