"""Translate with a trained model and score, or score existing translations.

Scores only (no model):
    python evaluate.py --hypotheses_file H --references_file R
prints sacreBLEU BLEU (with its signature), chrF and the paper-comparable tokenized BLEU, two decimals each.

Translate and score:
    python evaluate.py --workdir DIR [--config C] [--checkpoint latest|STEP] [--average_last N | --average_steps A,B]
        [--split valid|test | --source_file F [--references_file R]] [--beam_size B --alpha A] [--output_file O]
restores the parameters (the mean of the last N checkpoints up to --checkpoint; N defaults to config.eval.average_last),
decodes with beam search, writes one detokenized hypothesis per input line (empty line -> empty line), and prints
and writes a JSON report with the scores, the checkpoint steps and the decoding settings. `--source_file -` reads
stdin and writes each translation as soon as its line is read.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from absl import app, flags
from ml_collections import config_flags

from transformer_jax.errors import EvalError

FLAGS = flags.FLAGS
config_flags.DEFINE_config_file("config", None, "Config file; default: the config saved with the checkpoints.")
flags.DEFINE_string("workdir", None, "Training directory with checkpoints/ and the tokenizer.")
flags.DEFINE_string("checkpoint", "latest", "latest, or the step of the last checkpoint to use.")
flags.DEFINE_integer("average_last", None, "Average this many checkpoints ending at --checkpoint (config.eval).")
flags.DEFINE_list("average_steps", None, "Average exactly these checkpoint steps (instead of --average_last).")
flags.DEFINE_enum("split", "test", ["valid", "test"], "Split of the configured data to translate.")
flags.DEFINE_string("source_file", None, "Translate this file (one sentence a line; '-' = stdin) instead of --split.")
flags.DEFINE_string("references_file", None, "References, one a line, for --source_file or --hypotheses_file.")
flags.DEFINE_string("hypotheses_file", None, "Score this file against --references_file; no model is loaded.")
flags.DEFINE_integer("beam_size", None, "Beams (default config.eval.beam_size); 1 is greedy search.")
flags.DEFINE_float("alpha", None, "Length penalty exponent (default config.eval.alpha).")
flags.DEFINE_integer("max_extra_len", None, "Output tokens beyond the input length (default config.eval).")
flags.DEFINE_integer("batch_size", None, "Sentences per decoding batch (default config.eval.batch_size).")
flags.DEFINE_string("output_file", None, "Hypotheses file; default WORKDIR/eval/<name>.<steps>.txt (stdin: stdout).")
flags.DEFINE_string("scores_file", None, "JSON report; default OUTPUT_FILE.json.")


@dataclasses.dataclass
class Options:
    workdir: str
    config: Any = None  # ml_collections.ConfigDict or None (use the saved one)
    checkpoint: str = "latest"
    average_last: int | None = None
    average_steps: list[int] | None = None
    split: str = "test"
    source_file: str | None = None
    references_file: str | None = None
    beam_size: int | None = None
    alpha: float | None = None
    max_extra_len: int | None = None
    batch_size: int | None = None
    output_file: str | None = None
    scores_file: str | None = None


# -- checkpoints and tokenizer (the training and data packages) ---------------------------------------------------


class Restorer:
    """Reads checkpoints through transformer_jax.training; tests substitute a fake with the same three methods."""

    def __init__(self):
        try:
            from transformer_jax.training import checkpoints, state
        except ImportError as e:
            raise EvalError(f"checkpoint reading is not available (transformer_jax.training: {e})") from e
        self._ckpt, self._state = checkpoints, state

    def list_steps(self, workdir: str) -> list[int]:
        return self._ckpt.list_steps(workdir)

    def load_config(self, workdir: str):
        return self._ckpt.load_config(workdir)

    def config_differences(self, saved, current) -> list[str]:
        return self._ckpt.config_differences(saved.to_dict(), current.to_dict())

    def load_params(self, workdir: str, steps: list[int], config):
        """An iterator over the parameter pure dicts of `steps`, read one at a time."""
        _, abstract = self._state.abstract_train_state(config)
        return (self._ckpt.load_model_params(workdir, step, abstract) for step in steps)

    def tokenizer(self, config, workdir: str):
        from transformer_jax.data import tokenizer as tokenizer_lib

        if not config.data.tokenizer_model and not (Path(workdir) / tokenizer_lib.MODEL_FILENAME).exists():
            raise EvalError(
                f"no tokenizer in {workdir} ({tokenizer_lib.MODEL_FILENAME}) and config.data.tokenizer_model is "
                "empty; evaluate with the workdir the model was trained in"
            )
        return tokenizer_lib.get_tokenizer(config.data, workdir, vocab_size=config.model.vocab_size)


def choose_steps(available: list[int], options: Options, default_last_n: int) -> list[int]:
    """The checkpoint steps to average: explicit steps, or the last N up to --checkpoint."""
    from transformer_jax.evaluation.averaging import select_steps

    if not available:
        raise EvalError(f"no checkpoint in {Path(options.workdir) / 'checkpoints'}; train first or fix --workdir")
    if options.average_steps:
        return select_steps(available, None, options.average_steps)
    if options.checkpoint == "latest":
        last = available[-1]
    else:
        try:
            last = int(options.checkpoint)
        except ValueError as e:
            raise EvalError(f"--checkpoint must be 'latest' or a step number, got {options.checkpoint!r}") from e
        if last not in available:
            raise EvalError(f"no checkpoint for step {last} in {options.workdir}; available steps: {available}")
    n = options.average_last if options.average_last is not None else default_last_n
    candidates = [s for s in available if s <= last]
    if n > len(candidates):
        raise EvalError(
            f"asked to average the last {n} checkpoints up to step {last}, but only {len(candidates)} exist: "
            f"{candidates}; pass --average_last {len(candidates)} (or 1 for no averaging)"
        )
    return select_steps(candidates, n, None)


def restore_model(restorer: Restorer, options: Options):
    """(config, model with the averaged parameters, steps used)."""
    from flax import nnx

    from transformer_jax.evaluation.averaging import average_params
    from transformer_jax.model import build_model

    available = restorer.list_steps(options.workdir)
    if not available:
        raise EvalError(f"no checkpoint in {Path(options.workdir) / 'checkpoints'}; train first or fix --workdir")
    saved = restorer.load_config(options.workdir)
    config = saved if options.config is None else options.config
    if options.config is not None:
        diff = restorer.config_differences(saved, options.config)
        if diff:
            raise EvalError(
                "--config does not match the config saved with the checkpoints; differing keys (saved -> given): "
                + "; ".join(diff)
            )
    steps = choose_steps(available, options, config.eval.average_last)
    params = average_params(restorer.load_params(options.workdir, steps, config))
    model = build_model(config, rngs=nnx.Rngs(0))
    target = nnx.state(model, nnx.Param)
    expected = {k: v.shape for k, v in _flat(nnx.to_pure_dict(target)).items()}
    got = {k: v.shape for k, v in _flat(params).items()}
    if expected != got:
        keys = sorted(k for k in expected.keys() | got.keys() if expected.get(k) != got.get(k))
        details = "; ".join(f"{k}: checkpoint {got.get(k)} vs config {expected.get(k)}" for k in keys[:20])
        raise EvalError(f"the checkpoint's parameters do not fit the config's model: {details}")
    nnx.replace_by_pure_dict(target, params)
    nnx.update(model, target)
    model.eval()
    return config, model, steps


def _flat(tree: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# -- reading inputs -----------------------------------------------------------------------------------------------


def read_sources(path: str) -> list[str]:
    """Lines of a UTF-8 file split at LF only, each with its line ending removed (nothing else)."""
    try:
        with open(path, encoding="utf-8", newline="\n") as f:
            return [line.rstrip("\r\n") for line in f]
    except OSError as e:
        raise EvalError(f"cannot read {path}: {e.strerror or e}") from e


def split_pairs(config, split: str) -> tuple[list[str], list[str], str]:
    from transformer_jax.data import sources

    name = config.data.valid_split if split == "valid" else config.data.test_split
    pairs = sources.read_all(sources.open_split(config.data, name))
    return [s for s, _ in pairs], [t for _, t in pairs], name


# -- the two modes ------------------------------------------------------------------------------------------------


def score_only(hypotheses_file: str, references_file: str, scores_file: str | None = None) -> dict[str, Any]:
    from transformer_jax.evaluation import bleu

    scores = bleu.score_files(hypotheses_file, references_file)
    print(bleu.format_scores(scores))
    if scores_file:
        _write_json(scores_file, {"hypotheses_file": hypotheses_file, "references_file": references_file, **scores})
    return scores


def evaluate_model(options: Options, restorer: Restorer | None = None) -> dict[str, Any]:
    """Restores, translates, writes the hypotheses and the JSON report; returns the report."""
    from transformer_jax.evaluation import bleu
    from transformer_jax.evaluation.translate import translate

    restorer = restorer or Restorer()
    # Cheap input checks first, so a wrong file fails before the model is built.
    stdin = options.source_file == "-"
    references = None
    if options.references_file:
        references = bleu.read_lines(options.references_file)
    sources = None
    if options.source_file and not stdin:
        sources = read_sources(options.source_file)
        if references is not None:
            bleu.check_line_counts(sources, references, options.source_file, options.references_file)

    config, model, steps = restore_model(restorer, options)
    tokenizer = restorer.tokenizer(config, options.workdir)
    name = "stdin" if stdin else Path(options.source_file).name if options.source_file else None
    if options.source_file is None:
        if references is not None:
            raise EvalError("--references_file goes with --source_file; a --split brings its own references")
        sources, references, split_name = split_pairs(config, options.split)
        name = f"{options.split}({split_name})"
    settings = {
        "beam_size": options.beam_size if options.beam_size is not None else config.eval.beam_size,
        "alpha": options.alpha if options.alpha is not None else config.eval.alpha,
        "max_extra_len": options.max_extra_len if options.max_extra_len is not None else config.eval.max_extra_len,
        "batch_size": options.batch_size if options.batch_size is not None else config.eval.batch_size,
        "max_input_len": config.data.eval_max_len,
    }
    tag = f"step{steps[-1]}" + (f"-avg{len(steps)}" if len(steps) > 1 else "")
    output_file = options.output_file
    if output_file is None and not stdin:
        output_file = str(Path(options.workdir) / "eval" / f"{name}.{tag}.beam{settings['beam_size']}.txt")
    if stdin:
        hypotheses, stats = _translate_stream(model, tokenizer, settings, output_file)
        if references is not None:
            bleu.check_line_counts(hypotheses, references, "stdin", options.references_file)
    else:
        hypotheses, stats = translate(model, tokenizer, sources, progress=True, **settings)
        _write_lines(output_file, hypotheses)

    report = {
        "workdir": str(options.workdir),
        "checkpoint_steps": steps,
        "source": name,
        "references_file": options.references_file,
        "hypotheses_file": output_file,
        "decoding": settings,
        "stats": stats,
        "scores": bleu.score_all(hypotheses, references) if references is not None else None,
    }
    out = sys.stderr if (stdin and output_file is None) else sys.stdout
    if report["scores"] is not None:
        print(bleu.format_scores(report["scores"]), file=out)
    print(json.dumps(report, indent=1, default=str), file=out)
    scores_file = options.scores_file or (f"{output_file}.json" if output_file else None)
    if scores_file:
        _write_json(scores_file, report)
    return report


def _translate_stream(model, tokenizer, settings: dict, output_file: str | None) -> tuple[list[str], dict]:
    """Translates stdin one line at a time, writing each output as soon as it is ready."""
    from transformer_jax.evaluation.translate import translate

    settings = {**settings, "batch_size": 1}  # one line at a time: nothing waits for a full batch
    out = open(output_file, "w", encoding="utf-8") if output_file else sys.stdout
    hypotheses, totals = [], {}
    try:
        for line in sys.stdin:
            [hyp], stats = translate(model, tokenizer, [line.rstrip("\r\n")], **settings)
            out.write(hyp + "\n")
            out.flush()
            hypotheses.append(hyp)
            for key in ("sentences", "empty", "truncated", "hit_max_len", "src_tokens", "tgt_tokens", "seconds"):
                totals[key] = totals.get(key, 0) + stats[key]
    finally:
        if out is not sys.stdout:
            out.close()
    return hypotheses, totals


def _write_lines(path: str, lines: list[str]) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.writelines(line + "\n" for line in lines)


def _write_json(path: str, obj: Any) -> None:
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=1, default=str)
        f.write("\n")


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    from transformer_jax.evaluation.bleu import ScoreError

    try:
        if FLAGS.hypotheses_file:
            if not FLAGS.references_file:
                raise EvalError("--hypotheses_file needs --references_file")
            score_only(FLAGS.hypotheses_file, FLAGS.references_file, FLAGS.scores_file)
            return
    except (EvalError, ScoreError) as e:
        sys.exit(f"evaluate.py: error: {e}")
    # Model mode: these imports bring in JAX and the training code, which scoring alone does not need.
    from transformer_jax.evaluation.averaging import AveragingError

    errors: tuple[type[Exception], ...] = (EvalError, ScoreError, AveragingError)
    try:
        from transformer_jax.errors import DataError
        from transformer_jax.training.checkpoints import CheckpointError

        errors += (DataError, CheckpointError)
    except ImportError:
        pass
    try:
        if not FLAGS.workdir:
            raise EvalError("give --workdir (translate with a trained model) or --hypotheses_file (score only)")
        try:
            average_steps = [int(s) for s in FLAGS.average_steps] if FLAGS.average_steps else None
        except ValueError as e:
            raise EvalError(f"--average_steps must be step numbers, got {FLAGS.average_steps}") from e
        options = Options(
            workdir=FLAGS.workdir,
            config=FLAGS.config,
            checkpoint=FLAGS.checkpoint,
            average_last=FLAGS.average_last,
            average_steps=average_steps,
            split=FLAGS.split,
            source_file=FLAGS.source_file,
            references_file=FLAGS.references_file,
            beam_size=FLAGS.beam_size,
            alpha=FLAGS.alpha,
            max_extra_len=FLAGS.max_extra_len,
            batch_size=FLAGS.batch_size,
            output_file=FLAGS.output_file,
            scores_file=FLAGS.scores_file,
        )
        evaluate_model(options)
    except errors as e:
        sys.exit(f"evaluate.py: error: {e}")


if __name__ == "__main__":
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    app.run(main)
