"""Run a config's sweep: python -m transformer_jax.sweep --config configs/<file>.py[:arg] --workdir DIR
(docs/usage.md, "Sweeps and ablations"; launchers: docs/cluster.md)

A config file's `get_sweep(arg)` returns a list of dicts: {"name": readable-name, "<dotted.key>": value, ...}, each
optionally with "reference": {"valid_perplexity": x, "valid_bleu": y}, a published result to compare with (the
file's REFERENCE string names its source). --config.KEY=VALUE sets a config value in every variant, as for train.py.

Each run (variant x seed) trains in DIR/NAME (DIR/NAME/seed<i> with --seeds N > 1, or the config file's SEEDS = N:
seed i adds i to train.seed and data.shuffle_seed), is skipped when finished and resumed when interrupted, and then
translates the whole validation split (and the test split with --split test) with its last checkpoint, no
averaging, and the config's beam search. The results, DIR/results.csv/md/png (results_test.*), give each variant's
scores (with seeds: mean ± standard deviation and Δ against the first variant with its 95% interval) and sacreBLEU's
paired bootstrap against the first variant, from the stored translations (--aggregate_only rebuilds them). SIGTERM
saves the running run's checkpoint and stops the sweep (exit status 1); the same command resumes it, and resubmits
local or SLURM jobs that ended unfinished. Every run records its code version (code_version.json); one sweep
command at a time owns DIR (DIR/sweep.lock).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import sys
from collections.abc import Sequence

from absl import flags
from ml_collections import config_flags

from transformer_jax import cli
from transformer_jax.cli import USAGE_STATUS, exit_on_user_error, fail, parse_flags
from transformer_jax.errors import ConfigError, VariantInterrupted
from transformer_jax.evaluation.run import split_pairs
from transformer_jax.sweep import launch
from transformer_jax.sweep.results import (
    SPLITS,
    Split,
    add_significance,
    aggregate_seeds,
    decoded,
    describe,
    reference_columns,
    run_metrics,
    summarize_variant,
    write_results,
)
from transformer_jax.sweep.runner import (
    PROG,
    Run,
    Variant,
    configure_logging,
    load_config_module,
    num_seeds,
    runs,
    train_and_decode,
    train_command,
    variants,
)


def _flag_values(argv: Sequence[str]) -> flags.FlagValues:
    """The sweep's flags, in a FlagValues of their own: each call of `main` parses afresh (tests call it many
    times in one process), and importing this module defines nothing in the global absl FLAGS."""
    fv = flags.FlagValues()
    # config_flags reads argv to define the --config.KEY=VALUE override flags.
    config_flags.DEFINE_config_file(
        "config", None, "configs/<file>.py[:arg] defining get_sweep(arg)", flag_values=fv, sys_argv=list(argv)
    )
    flags.DEFINE_string("workdir", None, "one sub-directory per variant is made here", flag_values=fv)
    flags.DEFINE_bool("dry_run", False, "list the variants and their overrides, run nothing", flag_values=fv)
    flags.DEFINE_bool("print_commands", False, "print one train.py command per variant", flag_values=fv)
    flags.DEFINE_string("only", None, "run only the variant with this name", flag_values=fv)
    flags.DEFINE_bool(
        "aggregate_only", False, "only rebuild results.csv/md/png (results_test.* with --split test)", flag_values=fv
    )
    flags.DEFINE_enum(
        "split",
        "valid",
        list(SPLITS),
        "the split the results report: valid (results.*) or test (every finished run is also decoded on the test "
        "split; results_test.*)",
        flag_values=fv,
    )
    flags.DEFINE_integer(
        "seeds",
        None,
        "run every variant with this many seeds (default: the config file's SEEDS, else 1); "
        "seed i adds i to train.seed and data.shuffle_seed",
        lower_bound=1,
        flag_values=fv,
    )
    flags.DEFINE_bool(
        "status", False, "list each run's state (pending, running, finished, failed), run nothing", flag_values=fv
    )
    flags.DEFINE_enum("launcher", "sequential", launch.LAUNCHERS, "where runs train (docs/cluster.md)", flag_values=fv)
    flags.DEFINE_integer(
        "parallel", None, "most runs at once (local: default 1; slurm: default all)", lower_bound=1, flag_values=fv
    )
    flags.DEFINE_float(
        "time_min", 24 * 60, "a job's time limit in minutes (#SBATCH --time)", lower_bound=0.1, flag_values=fv
    )
    flags.DEFINE_integer(
        "gpus_per_node", 0, "GPUs per job (local) or node (slurm: --gpus-per-node)", lower_bound=0, flag_values=fv
    )
    flags.DEFINE_string("slurm_partition", None, "#SBATCH --partition", flag_values=fv)
    flags.DEFINE_integer("slurm_nodes", 1, "#SBATCH --nodes (one task per node)", lower_bound=1, flag_values=fv)
    flags.DEFINE_integer("slurm_cpus_per_task", None, "#SBATCH --cpus-per-task", lower_bound=1, flag_values=fv)
    flags.DEFINE_string("slurm_mem", None, "#SBATCH --mem, per node (e.g. 200G)", flag_values=fv)
    flags.DEFINE_string("slurm_account", None, "#SBATCH --account", flag_values=fv)
    flags.DEFINE_string("slurm_qos", None, "#SBATCH --qos", flag_values=fv)
    flags.DEFINE_multi_string(
        "slurm_extra", [], "KEY=VALUE: #SBATCH --KEY=VALUE; KEY: #SBATCH --KEY (repeatable)", flag_values=fv
    )
    flags.mark_flags_as_required(["config", "workdir"], flag_values=fv)
    return fv


def _launcher(fv: flags.FlagValues) -> launch.Launcher:
    """The launcher record of the flags; ConfigError for settings that cannot work together."""
    bad = [item for item in fv.slurm_extra if not item.partition("=")[0] or item.startswith("-")]
    if bad:
        raise ConfigError(f"--slurm_extra {bad[0]!r}: give KEY=VALUE or KEY (an sbatch option without its dashes)")
    slurm_set = [name for name in fv if name.startswith("slurm_") and fv[name].present]
    if slurm_set and fv.launcher != "slurm":
        raise ConfigError(f"--{slurm_set[0]} is for --launcher slurm (the launcher is {fv.launcher})")
    job_flags = [name for name in ("parallel", "time_min", "gpus_per_node") if fv[name].present]
    if job_flags and fv.launcher == "sequential":
        raise ConfigError(f"--{job_flags[0]} is for --launcher local or slurm (the sequential launcher runs no jobs)")
    settings = {f.name: fv[f.name].value for f in dataclasses.fields(launch.Launcher) if f.name != "name"}
    return launch.Launcher(name=fv.launcher, **{**settings, "slurm_extra": tuple(fv.slurm_extra)})


def main(argv: Sequence[str] | None = None) -> int:
    """argv: the flags (sys.argv[1:] when None). Exit status 1 if a variant was interrupted, 2 for a bad input."""
    argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
    fv = _flag_values(argv)
    rest = parse_flags(PROG, argv, fv, usage=__doc__)
    if len(rest) > 1:
        fail(PROG, f"unexpected arguments: {rest[1:]}")
    configure_logging()
    with exit_on_user_error(PROG, USAGE_STATUS):
        return _run(fv)


def _run(fv: flags.FlagValues) -> int:
    config_arg = config_flags.get_config_filename(fv["config"])
    workdir = pathlib.Path(fv.workdir)
    # The sweep's runs are one W&B group and one MLflow experiment, unless --config.train.tracker_group names one.
    common = {"train.tracker_group": workdir.resolve().name, **config_flags.get_override_values(fv["config"])}
    all_variants = variants(config_arg, common)
    seeds = num_seeds(config_arg, fv.seeds)
    all_runs = {v.name: runs(v, seeds) for v in all_variants}
    names = [v.name for v in all_variants]
    if fv.only is not None and fv.only not in names:
        raise ConfigError(f"--only {fv.only!r}: no such variant; the variants are {names}")
    chosen = [r for v in all_variants if fv.only in (None, v.name) for r in all_runs[v.name]]
    if fv.dry_run:
        for r in chosen:
            print(f"{r.label}: {json.dumps({**r.variant.overrides, **r.overrides})}")
        return 0
    if fv.print_commands:
        for r in chosen:
            overrides = {**common, **r.variant.overrides, **r.overrides}
            print(train_command(config_arg, workdir / r.label, overrides))
        return 0
    split = SPLITS[fv.split]
    cache = fv.compilation_cache  # for jobs
    tasks = [launch.RunJob(r.label, r.config, workdir / r.label, split, cache) for r in chosen]
    if fv.status:
        jobs = launch.load_jobs(workdir)
        for t in tasks:
            state, detail = launch.run_state(t.run_dir, jobs.get(t.label), t.split)
            print(f"{t.label}\t{state}" + (f"\t{detail}" if detail else ""))
        return 0
    launcher = _launcher(fv)
    cli.check_workdir(workdir)
    with launch.owned(workdir):
        interrupted = None if fv.aggregate_only else _train(launcher, tasks, workdir)
        _aggregate(config_arg, all_variants, all_runs, workdir, seeds, split)
    if interrupted:
        print(f"sweep interrupted: {interrupted}; run the same command to resume it", file=sys.stderr)
        return 1
    return 0


def _train(launcher: launch.Launcher, tasks: list[launch.RunJob], workdir: pathlib.Path) -> str | None:
    """Trains and decodes the chosen runs with the launcher; what stopped or failed, if anything did."""
    if launcher.name == "sequential":
        for t in tasks:
            logging.info("sweep: variant %s", t.label)
            try:
                train_and_decode(t.label, t.config, t.run_dir, t.split)
            except VariantInterrupted as e:
                return str(e)
        return None
    states = launch.launch(launcher, tasks, workdir)
    waiting = [label for label, state in states.items() if state in ("pending", "running")]
    if waiting:
        print(f"sweep: {len(waiting)} runs pending or running; --status lists them", file=sys.stderr)
    failed = [label for label, state in states.items() if state == "failed"]
    return f"runs {failed} failed (--status shows each one's last log line)" if failed else None


def _aggregate(
    config_arg: str,
    all_variants: list[Variant],
    all_runs: dict[str, list[Run]],
    workdir: pathlib.Path,
    seeds: int,
    split: Split,
) -> None:
    """The split's results files (results.csv/md/png, or results_test.*) of what has finished, the .md printed."""
    dirs = [[workdir / r.label for r in all_runs[v.name]] for v in all_variants]
    if seeds == 1:
        rows = [summarize_variant(v, d, split) for v, (d,) in zip(all_variants, dirs, strict=True)]
    else:
        entries = [
            {**describe(v), **reference_columns(v), "runs": [run_metrics(d, split) for d in variant_dirs]}
            for v, variant_dirs in zip(all_variants, dirs, strict=True)
        ]
        rows = aggregate_seeds(entries, seeds, split)
    finished = [[d if decoded(d, split) else None for d in variant_dirs] for variant_dirs in dirs]
    rows = add_significance(rows, finished, _references(all_variants, finished, split), split)
    label = getattr(load_config_module(config_arg.partition(":")[0]), "REFERENCE", "reference")
    write_results(rows, workdir, split, reference_label=label)
    print((workdir / f"{split.results_name}.md").read_text())


def _references(
    all_variants: list[Variant], finished: list[list[pathlib.Path | None]], split: Split
) -> list[list[str] | None]:
    """Each variant's references of the split (None: no finished run), read once per data config."""
    cache: dict[str, list[str]] = {}
    out = []
    for variant, runs_done in zip(all_variants, finished, strict=True):
        key = json.dumps(variant.config.data.to_dict(), sort_keys=True, default=str)
        if any(runs_done) and key not in cache:
            cache[key] = split_pairs(variant.config, split.name)[1]
        out.append(cache[key] if any(runs_done) else None)
    return out


if __name__ == "__main__":
    sys.exit(main())
