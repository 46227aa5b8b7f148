"""CTranslate2 weight quantization of a trained model: size, agreement with float32, BLEU and speed; JSON lines.

    python -m benchmarks.ct2_quantization --workdir runs/m30k [--lines N] [--threads 2] [--average_last 1]
        [--quantizations float32,int8,int8_float32,bfloat16] [--device cpu]

The workdir's model (its latest checkpoint, or the mean of --average_last) is exported once per quantization
(transformer_jax.interop.ctranslate2.to_ctranslate2, as `python -m transformer_jax.export --quantization Q` writes it)
and translates the first --lines sentences of Multi30k test2016 (test.en -> test.de under $TRANSFORMER_JAX_DATA's
multi30k/, else ../shared/data/multi30k beside this checkout; absent: one JSON line saying so, exit 0) greedily with
our tokenization and length limits (ctranslate2_translate). One JSON line per quantization: model.bin's bytes, the
compute type the engine chose on --device (a type the device lacks runs as the nearest one it has: bfloat16 on a
CPU without it runs float32), how many outputs are identical to float32's (count and share), sacreBLEU against
the references, and lines/s of the timed pass (after one untimed pass over the first batch, which loads the model).
"""

from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path

from absl import flags

from transformer_jax import cli, decoding
from transformer_jax.data.sources import local_data_dir
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, workdir_tokenizer
from transformer_jax.evaluation.translate import DecodeSettings, position_limit, sacrebleu_scores
from transformer_jax.interop.ctranslate2 import QUANTIZATIONS, ctranslate2_translate, to_ctranslate2

REPO = Path(__file__).resolve().parents[1]
FLOAT32 = "float32"  # the export without quantization, the reference of the others

_WORKDIR = flags.DEFINE_string("workdir", None, "A trained workdir.")
_LINES = flags.DEFINE_integer("lines", 0, "First lines of test2016 to translate; 0 = all (1000).")
_QUANTIZATIONS = flags.DEFINE_list(
    "quantizations", [FLOAT32, *QUANTIZATIONS], f"Exports to compare: {FLOAT32} and any of {list(QUANTIZATIONS)}."
)
_AVERAGE_LAST = flags.DEFINE_integer("average_last", 1, "Checkpoints to average (1: the latest alone).")
_THREADS = flags.DEFINE_integer("threads", 2, "CTranslate2's intra_threads.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Sentences per batch.")
_DEVICE = flags.DEFINE_enum("device", "cpu", ["cpu", "cuda"], "CTranslate2's device.")
flags.mark_flag_as_required("workdir")


def test2016() -> tuple[Path, str | None]:
    """The Multi30k copy's folder, and why it cannot be used (None when test.en and test.de are there)."""
    folder = (local_data_dir() or REPO.parent / "shared" / "data") / "multi30k"
    missing = [name for name in ("test.en", "test.de") if not (folder / name).is_file()]
    return (
        folder,
        f"Multi30k test2016 not found ({folder}/{missing[0]}); set $TRANSFORMER_JAX_DATA" if missing else None,
    )


def main(argv: list[str]) -> None:
    del argv
    import ctranslate2  # optional (pip install -e .[ctranslate2]): only this benchmark and the export need it

    unknown = sorted(set(_QUANTIZATIONS.value) - {FLOAT32, *QUANTIZATIONS})
    if unknown:
        raise EvalError(f"--quantizations: unknown {unknown}; choose from {[FLOAT32, *QUANTIZATIONS]}")
    folder, missing = test2016()
    if missing:
        print(json.dumps({"skipped": missing}))
        return
    limit = _LINES.value or None
    sources = (folder / "test.en").read_text(encoding="utf-8").splitlines()[:limit]
    references = (folder / "test.de").read_text(encoding="utf-8").splitlines()[:limit]

    workdir = _WORKDIR.value
    config, model, steps = restore_model(workdir, CheckpointChoice(average_last=_AVERAGE_LAST.value))
    tokenizer = workdir_tokenizer(config, workdir)
    settings = DecodeSettings(
        decoding.search_for(1, config.eval.alpha),
        max_extra_len=config.eval.max_extra_len,
        max_len=config.eval.max_len,
        batch_size=_BATCH_SIZE.value,
        max_input_len=config.data.eval_max_len,
    )
    max_positions = config.data.eval_max_len + config.eval.max_extra_len
    reference_outputs = None
    order = sorted(_QUANTIZATIONS.value, key=lambda q: q != FLOAT32)  # float32 first: the others compare with it
    with tempfile.TemporaryDirectory() as tmp:
        for quantization in order:
            path = to_ctranslate2(
                model,
                tokenizer,
                Path(tmp) / quantization,
                max_positions=max_positions,
                quantization=None if quantization == FLOAT32 else quantization,
            )
            translator = ctranslate2.Translator(str(path), device=_DEVICE.value, intra_threads=_THREADS.value)

            def run(lines: list[str], translator=translator) -> list[str]:
                return ctranslate2_translate(
                    translator, tokenizer, lines, settings, position_limit=position_limit(model.spec)
                )[0]

            run(sources[: _BATCH_SIZE.value])  # untimed: the first batch pays for allocations
            start = time.perf_counter()
            outputs = run(sources)
            seconds = time.perf_counter() - start
            if quantization == FLOAT32:
                reference_outputs = outputs
            report = {
                "workdir": workdir,
                "steps": steps,
                "quantization": quantization,
                "compute_type": translator.compute_type,
                "device": _DEVICE.value,
                "threads": _THREADS.value,
                "model_bin_bytes": (path / "model.bin").stat().st_size,
                "lines": len(sources),
                "sacrebleu": round(sacrebleu_scores(outputs, references)["bleu"]["score"], 2),
                "lines_per_s": round(len(sources) / seconds, 1),
            }
            if reference_outputs is not None:
                same = sum(a == b for a, b in zip(outputs, reference_outputs, strict=True))
                report.update(identical_to_float32=same, identical_share=round(same / len(sources), 4))
            print(json.dumps(report), flush=True)


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.ct2_quantization")
