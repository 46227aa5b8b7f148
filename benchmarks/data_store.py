"""The tokenized training store at WMT14's size: build time, restart time to the first step, peak RSS. JSON lines.

  python -m benchmarks.data_store [--modes throughput,scale] [--pairs 4500000] [--in_memory]

scale: synthesises a corpus of --pairs lines per side in a temporary directory under --tmp (each line two random
Multi30k training sentences, the same two on both sides, so lines are ~26 words like WMT14's), then, each in its
own process whose peak RSS is measured: trains the tokenizer (a streamed sample of --sample_sentences), builds the
store (`python -m transformer_jax.data.prepare`), runs train.py for one step (a tiny model, so compilation is
small) and restarts it from that checkpoint for one more. For the restart, `store_opened_s` is the time from
starting the process until the store is open (JAX and the model library imported, checkpoint not yet restored)
and `first_step_s` until its first step's metrics line, compilation included. --in_memory also restarts with
data.store=False (today's path: read and tokenize everything at every start). Everything is deleted at the end.

throughput: batches per second from the store and from the in-memory path on Multi30k train (the same batches),
after setup, on one core.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from absl import flags

from configs import common
from transformer_jax import cli
from transformer_jax.data import pipeline, store
from transformer_jax.data import tokenizer as tokenizer_lib
from transformer_jax.data.sources import local_data_dir
from transformer_jax.model.layers import SpecialIds

REPO = Path(__file__).resolve().parents[1]
DATA = local_data_dir() or Path("$TRANSFORMER_JAX_DATA")  # the local corpora; unset, the benchmark skips

_MODES = flags.DEFINE_list("modes", ["throughput", "scale"], "What to measure: throughput, scale.")
_PAIRS = flags.DEFINE_integer("pairs", 4_500_000, "Lines per side of the synthetic corpus (scale).")
_TMP = flags.DEFINE_string("tmp", tempfile.gettempdir(), "Where the synthetic corpus and runs go (then deleted).")
_VOCAB_SIZE = flags.DEFINE_integer("vocab_size", 8000, "Pieces of the tokenizer (Multi30k has ~10k words a side).")
_SAMPLE = flags.DEFINE_integer("sample_sentences", 200_000, "Sentences sampled to train the tokenizer (scale).")
_BATCHES = flags.DEFINE_integer("batches", 1500, "Batches timed per path and round (throughput).")
_ROUNDS = flags.DEFINE_integer("rounds", 5, "Alternating rounds of the two paths (throughput).")
_IN_MEMORY = flags.DEFINE_bool("in_memory", False, "Also restart with data.store=False (scale; slow at 4.5M pairs).")
_STEP = flags.DEFINE_string("child", "", "Internal: run one step in this process (tokenizer).")
_WORKDIR = flags.DEFINE_string("workdir", "", "Internal: the child's workdir.")
_CORPUS = flags.DEFINE_string("corpus", "", "Internal: the child's corpus directory.")

# A child process: runs the command, then reports its exit status and peak RSS (the only grandchild's).
MEASURE = (
    "import json, resource, subprocess, sys\n"
    "rc = subprocess.run(sys.argv[2:]).returncode\n"
    "rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss\n"
    "open(sys.argv[1], 'w').write(json.dumps({'rc': rc, 'peak_rss_mb': round(rss / 1024)}))\n"
)


STORE_OPENED = "pairs (memory-mapped)"  # store.open_train_store's log line on a start that finds the store


def emit(**record) -> None:
    print(json.dumps(record), flush=True)


def data_config(corpus: Path, workdir: Path) -> list[str]:
    """The overrides that point configs/quickstart.py (a 1+1-layer model here) at the synthetic corpus."""
    return [
        "--config.data.source=text",
        f"--config.data.text_dir={corpus}",
        f"--config.data.tokenizer_model={workdir / 'spm.model'}",
        f"--config.model.vocab_size={_VOCAB_SIZE.value}",
        "--config.model.num_encoder_layers=1",
        "--config.model.num_decoder_layers=1",
        "--config.train.peak_flops=1e11",  # only for the MFU figure; 0 would time a matmul at every start
    ]


def measured(command: list[str], log: Path, *, until_step: tuple[Path, int] | None = None) -> dict:
    """Runs `command` in a child; wall seconds, peak RSS and, with until_step, seconds until it has opened the
    store (its log line; None without a store) and until that step's metrics."""
    report = log.with_suffix(".rss.json")
    start = time.perf_counter()
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", MEASURE, str(report), *command], cwd=REPO, stdout=out, stderr=subprocess.STDOUT
        )
        first_step_s = store_opened_s = None
        while proc.poll() is None:
            if until_step and store_opened_s is None and STORE_OPENED in log.read_text(errors="replace"):
                store_opened_s = time.perf_counter() - start
            if until_step and first_step_s is None and _has_step(*until_step):
                first_step_s = time.perf_counter() - start
            time.sleep(0.05)
    wall = time.perf_counter() - start
    result = json.loads(report.read_text())
    if result["rc"]:
        raise RuntimeError(f"{' '.join(command)} failed ({result['rc']}); its output:\n{log.read_text()[-3000:]}")
    out = {"seconds": round(wall, 1), "peak_rss_mb": result["peak_rss_mb"]}
    if until_step:
        out["store_opened_s"] = round(store_opened_s, 1) if store_opened_s is not None else None
        out["first_step_s"] = round(first_step_s if first_step_s is not None else wall, 1)
    return out


def _has_step(metrics: Path, step: int) -> bool:
    """Whether metrics.jsonl has the training metrics of `step` (a line still being written is not read)."""
    if not metrics.exists():
        return False
    for line in metrics.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if record.get("step") == step and "loss" in record:
            return True
    return False


def synthesize(directory: Path, pairs: int, seed: int = 0) -> dict:
    """`pairs` lines per side, each two random Multi30k training sentences (the same two on both sides)."""
    start = time.perf_counter()
    directory.mkdir(parents=True)
    sentences = {
        lang: (DATA / "multi30k" / f"train.{lang}").read_text(encoding="utf-8").splitlines() for lang in ("en", "de")
    }
    rng = np.random.default_rng(seed)
    with (
        open(directory / "train.en", "w", encoding="utf-8") as en,
        open(directory / "train.de", "w", encoding="utf-8") as de,
    ):
        for first in range(0, pairs, 200_000):
            a, b = rng.integers(0, len(sentences["en"]), (2, min(200_000, pairs - first))).tolist()
            for f, lang in ((en, "en"), (de, "de")):
                s = sentences[lang]
                f.write("".join(f"{s[i]} {s[j]}\n" for i, j in zip(a, b, strict=True)))
    for split in ("valid", "test"):
        for lang in ("en", "de"):
            shutil.copy(DATA / "multi30k" / f"{split}.{lang}", directory / f"{split}.{lang}")
    size = sum((directory / f"train.{lang}").stat().st_size for lang in ("en", "de"))
    return {"synthesis_s": round(time.perf_counter() - start, 1), "corpus_mb": round(size / 2**20)}


def scale(pairs: int) -> None:
    base = Path(tempfile.mkdtemp(prefix="data_store_bench.", dir=_TMP.value))
    try:
        corpus, workdir = base / "corpus", base / "run"
        record = {"benchmark": "data_store", "mode": "scale", "pairs": pairs, **synthesize(corpus, pairs)}
        emit(**record, stage="synthesized")
        workdir.mkdir()
        me = [sys.executable, "-m", "benchmarks.data_store", f"--vocab_size={_VOCAB_SIZE.value}"]
        child = [
            *me,
            "--child=tokenizer",
            f"--workdir={workdir}",
            f"--corpus={corpus}",
            f"--sample_sentences={_SAMPLE.value}",
        ]
        record["tokenizer"] = measured(child, base / "tokenizer.log")
        emit(**record, stage="tokenizer")
        config = [*data_config(corpus, workdir)]
        prepare = [
            sys.executable,
            "-m",
            "transformer_jax.data.prepare",
            "--config",
            "configs/quickstart.py",
            "--workdir",
            str(workdir),
            *config,
        ]
        record["build"] = measured(prepare, base / "prepare.log")
        manifest = store.read_manifest(next(workdir.glob("*.store")))
        record["build"].update(manifest["counts"], build_s=manifest["build_seconds"])
        record["store_mb"] = round(sum(f.stat().st_size for f in next(workdir.glob("*.store")).iterdir()) / 2**20)
        emit(**record, stage="build")
        train = [sys.executable, "train.py", "--config", "configs/quickstart.py", "--workdir", str(workdir / "train")]
        train += [*config, "--config.train.eval_every=0", "--config.train.log_every=1", "--config.ckpt.every_steps=1"]
        metrics = workdir / "train" / "metrics.jsonl"
        record["first_run"] = measured(
            [*train, "--config.train.num_steps=1"], base / "train1.log", until_step=(metrics, 1)
        )
        record["restart"] = measured(
            [*train, "--config.train.num_steps=2"], base / "train2.log", until_step=(metrics, 2)
        )
        emit(**record, stage="restart")
        if _IN_MEMORY.value:
            record["restart_in_memory"] = measured(
                [*train, "--config.train.num_steps=3", "--config.data.store=False"],
                base / "train3.log",
                until_step=(metrics, 3),
            )
        emit(**record, stage="done")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def tokenizer_child() -> None:
    """Trains the tokenizer from a streamed sample of the synthetic corpus (the child process of `scale`)."""
    config = common.data_config()
    config.text_dir, config.tokenizer_sample_sentences = _CORPUS.value, _SAMPLE.value
    start = time.perf_counter()
    tokenizer_lib.get_tokenizer(config, _WORKDIR.value, vocab_size=_VOCAB_SIZE.value, ids=SpecialIds.DEFAULT)
    print(json.dumps({"tokenizer_s": round(time.perf_counter() - start, 1)}))


def throughput() -> None:
    """Batches per second from the store and in memory, on Multi30k train, one core, after setup.

    The two paths alternate for --rounds rounds (so machine noise hits both alike); each line gives the best and
    the median round.
    """
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    config = common.data_config()
    config.text_dir, config.tokenizer_sample_sentences = str(DATA / "multi30k"), 58_000
    with tempfile.TemporaryDirectory(dir=_TMP.value) as workdir:
        tokenizer = tokenizer_lib.get_tokenizer(config, workdir, vocab_size=_VOCAB_SIZE.value, ids=SpecialIds.DEFAULT)
        start = time.perf_counter()
        examples, _ = store.open_train_store(config, tokenizer, build_if_missing=True, num_threads=1)
        build_s = time.perf_counter() - start
        rates: dict[str, list[float]] = {"in_memory": [], "store": []}
        setup: dict[str, float] = {}
        for _ in range(_ROUNDS.value):
            for name, given in (("in_memory", None), ("store", examples)):
                start = time.perf_counter()
                it, stats = pipeline.make_train_iterator(
                    config, tokenizer, examples=given, process_index=0, process_count=1, num_threads=1
                )
                setup[name] = time.perf_counter() - start
                start = time.perf_counter()
                for _ in range(_BATCHES.value):
                    next(it)
                rates[name].append(_BATCHES.value / (time.perf_counter() - start))
        for name, values in rates.items():
            emit(
                benchmark="data_store",
                mode="throughput",
                path=name,
                batches_per_s_best=round(max(values), 1),
                batches_per_s_median=round(float(np.median(values)), 1),
                rounds=len(values),
                setup_s=round(setup[name], 3),
                store_build_s=round(build_s, 2) if name == "store" else None,
                batching=config.batching,
                batch_size=config.batch_size,
                max_len=config.max_len,
                kept=stats["kept"],
            )


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    if _STEP.value == "tokenizer":
        return tokenizer_child()
    if not (DATA / "multi30k" / "train.en").exists():
        emit(benchmark="data_store", skipped=f"shared corpora not found at {DATA} (set TRANSFORMER_JAX_DATA)")
        return None
    if "throughput" in _MODES.value:
        throughput()
    if "scale" in _MODES.value:
        scale(_PAIRS.value)
    return None


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.data_store")
