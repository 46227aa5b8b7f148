"""Train a Transformer: python train.py --config configs/<file>.py[:arg] --workdir DIR [--config.<key>=<value>]

Starting in a workdir that has checkpoints resumes from the latest. --dry_run and --plan (docs/plan.md, needs
requirements-aot.txt) touch no data and train nothing.
"""

from __future__ import annotations

import json
import logging

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli
from transformer_jax.errors import ConfigError
from transformer_jax.sharding import initialize_distributed
from transformer_jax.training import init_from
from transformer_jax.training.loop import dry_run_summary, train_and_evaluate

_CONFIG = config_flags.DEFINE_config_file("config", None, "Config file, e.g. configs/multi30k.py:size=small.")
_WORKDIR = flags.DEFINE_string("workdir", None, "Directory for checkpoints, tokenizer, metrics.jsonl, TensorBoard.")
_DRY_RUN = flags.DEFINE_bool("dry_run", False, "Print the model summary, FLOPs, batch shapes, mesh and exit.")
_PLAN = flags.DEFINE_string("plan", None, "Compile the train step for a TPU/GPU slice (v5e-8, v5e:2x4, v4-32, h100:8).")
_PLAN_JSON = flags.DEFINE_bool("plan_json", False, "Print the --plan report as JSON instead of a table.")
_PLAN_SEARCH = flags.DEFINE_enum(
    "plan_search", "", ["", "batch", "mesh"], "--plan: the largest batch that fits, or data vs fsdp side by side."
)


def _bleu_evaluator(config, tokenizer):
    # Imported only when a run validates BLEU: a run without it, or a restart before its first step, need not wait
    # for translation's imports (decoding, sacreBLEU).
    from transformer_jax.evaluation.translate import bleu_evaluator

    return bleu_evaluator(config, tokenizer)


def _plan(config) -> None:
    # Imported only for --plan: the plan compiles decoding too, whose imports a training run need not wait for.
    import jax

    from transformer_jax.plan import report

    # This host only compiles: its backend is the CPU's even where libtpu or the CUDA plugin is installed.
    jax.config.update("jax_platforms", "cpu")
    result = report.run(config, _PLAN.value, _PLAN_SEARCH.value)
    print(report.render(result, config, as_json=_PLAN_JSON.value))
    report.check_fits(result, config)  # after the report: it shows by how much


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)  # orbax logs every file it renames at INFO
    config = _CONFIG.value
    # Before any work: a bad value, or a tracker whose package is missing, is one line now, not a traceback minutes
    # later; a comma-joined list-valued key becomes its tuple here.
    cli.validate(config, training=True)
    overrides = tuple(config_flags.get_override_values(flags.FLAGS[_CONFIG.name]))  # --config.KEY=VALUE given
    if _PLAN.value or _DRY_RUN.value:
        config = init_from.planned_config(config, overrides)  # a fine-tuning run's model is its source's
    if _PLAN.value:
        _plan(config)
        return
    if not _DRY_RUN.value:
        if not _WORKDIR.value:
            raise ConfigError("--workdir is required (checkpoints, tokenizer and metrics go there)")
        cli.check_workdir(_WORKDIR.value)
    initialize_distributed()
    if _DRY_RUN.value:
        print(json.dumps(dry_run_summary(config), indent=2))
        return
    train_and_evaluate(config, _WORKDIR.value, bleu=_bleu_evaluator, overrides=overrides)


if __name__ == "__main__":
    flags.mark_flag_as_required("config")
    cli.run(main, "train.py")
