"""Evaluation runs: translate a split or a file with a restored model and score it, or score existing translations.

evaluate.py is the command line over `evaluate_model` and `score_only`; the checkpoint restoring is in
`transformer_jax.evaluation.restore`.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from transformer_jax.errors import EvalError
from transformer_jax.evaluation.restore import Restorer, restore_model


@dataclasses.dataclass
class Options:
    """What to translate with which checkpoints and settings; None means the config's value (config.eval)."""

    workdir: str
    config: Any = None  # ml_collections.ConfigDict, or None: the one saved with the checkpoints
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

    config, model, steps = restore_model(
        restorer,
        options.workdir,
        config=options.config,
        checkpoint=options.checkpoint,
        average_last=options.average_last,
        average_steps=options.average_steps,
    )
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
        hypotheses, stats = translate_stream(model, tokenizer, settings, output_file)
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


def translate_stream(model, tokenizer, settings: dict, output_file: str | None) -> tuple[list[str], dict]:
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
