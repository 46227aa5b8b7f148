"""What a user waits for: whole processes, start to exit, with the persistent compilation cache cold and warm.

    python -m benchmarks.decode --workdir W --fresh_process [--beam_sizes 4,1 --repeats 2]
    python -m benchmarks.train_step --config configs/multi30k.py:size=small --fresh_process [--repeats 2]

Translation (`evaluate_vs_ctranslate2`): for each beam size, `evaluate.py --source_file` translates the split's
sources in a fresh process, first with an empty cache directory of its own (cold: every program compiled and
written), then `repeats` more times (warm: loaded from that directory), against a process that loads the same
weights exported for CTranslate2 and translates the same file (benchmarks/ctranslate2_process.py), run between
ours so that both meet the same machine load: once with one engine call per output limit (every output under our
limit, as the in-process comparison runs it) and once with one call for all (what a CTranslate2 user would
write). Each process is timed from its start to its exit, by which point its last line is written.

Training restart (`restart_times`): a workdir with a checkpoint at step 1 (made by a first run, which also fills
the cache), then restarts that each train one more step, alternately with the cache off and warm; timed from the
process's start to its "is this process's first" log line (training/loop.py), i.e. until the first step is done.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, workdir_tokenizer
from transformer_jax.evaluation.run import read_sources, split_pairs
from transformer_jax.evaluation.translate import (
    input_limit,
    output_cap,
    output_limit,
    position_limit,
    sacrebleu_scores,
    source_ids,
)
from transformer_jax.interop.ctranslate2 import to_ctranslate2

REPO = Path(__file__).resolve().parent.parent
FIRST_STEP_LINE = "is this process's first"  # training/loop.py's log line after a process's first step


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def timed_process(command: list[str], log: Path, until: str | None = None) -> float:
    """Seconds from the process's start to its exit, or to its first output line containing `until`; its output
    goes to `log`; a failure (or no such line) raises with the log's last lines."""
    start, seconds = time.perf_counter(), None
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.Popen(
            command, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in proc.stdout:
            out.write(line)
            if seconds is None and until is not None and until in line:
                seconds = time.perf_counter() - start
        code = proc.wait()
    if until is None:
        seconds = time.perf_counter() - start
    if code != 0 or seconds is None:
        tail = log.read_text(encoding="utf-8", errors="replace").splitlines()[-5:]
        missing = f" without a line {until!r}" if seconds is None else ""
        raise RuntimeError(f"{' '.join(command[:3])} ... exited {code}{missing}: {' | '.join(tail)}")
    return seconds


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _lines(path: Path) -> list[str]:
    return path.read_text(encoding="utf-8").split("\n")[:-1]


def _limits(config, model, tokenizer, sources: list[str]) -> tuple[list[int], int]:
    """Each line's output limit by our rule (0 for a blank line) and the most source tokens kept (EOS included)."""
    limit = position_limit(model.spec)
    max_input = input_limit(config.data.eval_max_len, limit)
    limits, cap = [], output_cap(config.eval.max_len, limit)
    for sentence in sources:
        ids, _ = source_ids(tokenizer, sentence, max_input)
        limits.append(0 if ids is None else output_limit(len(ids), config.eval.max_extra_len, cap))
    return limits, max_input


def _ctranslate2_commands(job: dict, tmp: Path, name: str) -> dict[str, list[str]]:
    """CTranslate2's processes for `job` (benchmarks/ctranslate2_process.py), by their names in the report: one call
    per output limit, and one call for all (what a CTranslate2 user would write), each with job's threads inside
    one translation (intra_threads); and one call for all with as many translations at once, one thread each
    (inter_threads, CTranslate2's way of using cores for throughput)."""
    variants = {
        "ctranslate2": {"one_call": False},
        "ctranslate2_one_call": {"one_call": True},
        "ctranslate2_one_call_inter": {"one_call": True, "inter_threads": job["threads"], "threads": 1},
    }
    commands = {}
    for kind, changes in variants.items():
        path = tmp / f"job.{name}.{kind}.json"
        path.write_text(json.dumps({**job, **changes}), encoding="utf-8")
        commands[kind] = [sys.executable, "-m", "benchmarks.ctranslate2_process", str(path)]
    return commands


def _race(ours: list[str], theirs: dict[str, list[str]], tmp: Path, repeats: int) -> dict[str, list[float]]:
    """Seconds of each process: ours cold (its cache directory empty) then `repeats` times warm, each followed by
    CTranslate2's, so that both meet the same machine load."""
    runs: dict[str, list[float]] = {"ours_cold": [], "ours_warm": [], **{kind: [] for kind in theirs}}
    for i in range(repeats + 1):
        kind = "ours_cold" if i == 0 else "ours_warm"
        runs[kind].append(round(timed_process(ours, tmp / f"{kind}.log"), 2))
        for other, command in theirs.items():
            runs[other].append(round(timed_process(command, tmp / f"{other}.log"), 2))
    return runs


def _ratios(runs: dict[str, list[float]]) -> dict[str, float | None]:
    """Our best cold and warm process time over each CTranslate2 variant's best."""
    best = {k: min(v) for k, v in runs.items() if v}
    theirs_best = min(v for k, v in best.items() if k.startswith("ctranslate2"))
    out = {}
    for ours in ("warm", "cold"):
        mine = best.get(f"ours_{ours}")
        for theirs in sorted(k for k in best if k.startswith("ctranslate2")):
            out[f"{ours}_over_{theirs}"] = round(mine / best[theirs], 2) if mine else None
        out[f"{ours}_over_ctranslate2_fastest"] = round(mine / theirs_best, 2) if mine else None
    return out


def evaluate_vs_ctranslate2(
    workdir: str,
    *,
    split: str,
    beam_sizes: list[int],
    batch_size: int,
    threads: int,
    alpha: float,
    average_last: int | None,
    repeats: int,
) -> list[dict]:
    """One report per beam size (module docstring): evaluate.py on the split against CTranslate2."""
    config, model, steps = restore_model(workdir, CheckpointChoice(average_last=average_last))
    sources, references, name = split_pairs(config, split)

    def ours(source_file: Path, output: Path) -> list[str]:
        return ["evaluate.py", f"--source_file={source_file}", f"--output_file={output}"]

    return _versus_ctranslate2(
        workdir,
        (config, model, steps),
        sources,
        references,
        ours,
        {"split": name},
        beam_sizes=beam_sizes,
        batch_size=batch_size,
        threads=threads,
        alpha=alpha,
        average_last=average_last,
        repeats=repeats,
    )


def corpus_vs_ctranslate2(
    workdir: str,
    corpus: str,
    *,
    lines: int,
    beam_sizes: list[int],
    batch_size: int,
    threads: int,
    alpha: float,
    average_last: int | None,
    repeats: int,
) -> list[dict]:
    """One report per beam size: the whole `python -m transformer_jax.translate_corpus` process on the first
    `lines` lines of `corpus` (0: all) against CTranslate2's whole process on the same lines."""
    config, model, steps = restore_model(workdir, CheckpointChoice(average_last=average_last))
    sources = read_sources(corpus)
    sources = sources[:lines] if lines else sources

    def ours(source_file: Path, output: Path) -> list[str]:
        return ["-m", "transformer_jax.translate_corpus", f"--input={source_file}", f"--output={output}"]

    return _versus_ctranslate2(
        workdir,
        (config, model, steps),
        sources,
        None,
        ours,
        {"corpus": corpus},
        beam_sizes=beam_sizes,
        batch_size=batch_size,
        threads=threads,
        alpha=alpha,
        average_last=average_last,
        repeats=repeats,
    )


def _versus_ctranslate2(
    workdir: str,
    restored: tuple,
    sources: list[str],
    references: list[str] | None,
    ours_command: Callable[[Path, Path], list[str]],
    described: dict,
    *,
    beam_sizes: list[int],
    batch_size: int,
    threads: int,
    alpha: float,
    average_last: int | None,
    repeats: int,
) -> list[dict]:
    """For each beam size, our process (ours_command(source file, output file), with the workdir, search and cache
    flags added) cold and warm against CTranslate2's processes with the same weights on the same lines."""
    config, model, steps = restored
    tokenizer = workdir_tokenizer(config, workdir)
    limits, max_input = _limits(config, model, tokenizer, sources)
    reports = []
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        source_file = tmp / "source.txt"
        source_file.write_text("".join(f"{line}\n" for line in sources), encoding="utf-8")
        export_dir = to_ctranslate2(model, tokenizer, tmp / "ct2")
        del model
        for beam_size in beam_sizes:
            cache = tmp / f"xla-beam{beam_size}"
            ours_out, theirs_out = tmp / f"ours.{beam_size}.txt", tmp / f"ct2.{beam_size}.txt"
            ours = [sys.executable, *ours_command(source_file, ours_out), f"--workdir={workdir}"]
            ours += [f"--beam_size={beam_size}", f"--alpha={alpha}", f"--batch_size={batch_size}"]
            ours += [f"--compilation_cache={cache}"] + ([f"--average_last={average_last}"] if average_last else [])
            job = {
                "model_dir": str(export_dir),
                "spm_model": str(tokenizer.path),
                "source_file": str(source_file),
                "output_file": str(theirs_out),
                "limits": limits,
                "max_input_pieces": max_input - 1,
                "beam_size": beam_size,
                "alpha": alpha,
                "batch_size": batch_size,
                "threads": threads,
            }
            runs = _race(ours, _ctranslate2_commands(job, tmp, f"beam{beam_size}"), tmp, repeats)
            hyps, theirs_hyps = _lines(ours_out), _lines(theirs_out)
            report = {"workdir": workdir, "steps": steps, **described, "sentences": len(sources)}
            report.update(beam_size=beam_size, batch_size=batch_size, cores=os.cpu_count())
            report.update(
                ctranslate2_threads=threads, seconds=runs, **_ratios(runs), cache_bytes=directory_bytes(cache)
            )
            if references is not None:
                report["bleu"] = {
                    "ours": round(sacrebleu_scores(hyps, references)["bleu"]["score"], 2),
                    "ctranslate2": round(sacrebleu_scores(theirs_hyps, references)["bleu"]["score"], 2),
                }
            report["identical_outputs"] = sum(a == b for a, b in zip(hyps, theirs_hyps, strict=True))
            reports.append(report)
            print(json.dumps(report), flush=True)
    return reports


def config_arguments(argv: list[str]) -> list[str]:
    """The --config and --config.KEY arguments of a command line, as given (each as one --flag=value)."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--config" or (arg.startswith("--config.") and "=" not in arg):
            out.append(f"{arg}={argv[i + 1]}")
            i += 1
        elif arg.startswith("--config=") or arg.startswith("--config."):
            out.append(arg)
        i += 1
    return out


def restart_times(config_arguments: list[str], repeats: int) -> dict:
    """Restarts of train.py (module docstring): seconds to the first step with the cache off and warm."""
    with tempfile.TemporaryDirectory() as tmp_dir:
        tmp = Path(tmp_dir)
        workdir, cache = tmp / "run", tmp / "xla"
        base = [sys.executable, "train.py", *config_arguments, f"--workdir={workdir}"]
        base += ["--config.train.log_every=1", "--config.ckpt.every_steps=1"]
        base += ["--config.train.eval_every=0", "--config.train.bleu_every=0"]
        first = timed_process(
            base + ["--config.train.num_steps=1", f"--compilation_cache={cache}"], tmp / "0.log", until=FIRST_STEP_LINE
        )
        times: dict[str, list[float]] = {"off": [], "warm": []}
        step = 1
        for _ in range(repeats):
            for mode in ("off", "warm"):
                step += 1
                setting = "off" if mode == "off" else str(cache)
                command = base + [f"--config.train.num_steps={step}", f"--compilation_cache={setting}"]
                times[mode].append(round(timed_process(command, tmp / f"{step}.log", until=FIRST_STEP_LINE), 2))
        return {
            "config": config_arguments,
            "first_run_cold_s": round(first, 2),
            "restart_to_first_step_s": times,
            "speedup_warm_over_off": round(min(times["off"]) / min(times["warm"]), 2),
            "cache_bytes": directory_bytes(cache),
            "cache_files": sum(1 for f in cache.rglob("*") if f.is_file()),
        }
