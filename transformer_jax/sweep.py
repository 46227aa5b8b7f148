"""Run a config's sweep: python -m transformer_jax.sweep --config configs/<file>.py[:arg] --workdir DIR

A config file's `get_sweep(arg)` returns a list of dicts: {"name": readable-name, "<dotted.key>": value, ...}.
Each variant trains in DIR/<name> with its resolved config saved there; a finished variant is skipped and an
interrupted one resumes from its checkpoints. --dry_run lists the variants, --print_commands prints one train.py
command per variant (for a cluster launcher), --only NAME runs one. Results are aggregated into DIR/results.csv,
DIR/results.md and DIR/results.png from the variants' metrics.jsonl.
"""

from __future__ import annotations

import csv
import importlib.util
import json
import logging
import pathlib
import re
import shlex
import sys
import time
from typing import Any

import ml_collections

from transformer_jax.errors import ConfigError

RESULT_FILE = "sweep_result.json"
NAME_PATTERN = re.compile(r"^[A-Za-z0-9_.=-]+$")


def load_config_module(path: str):
    """Imports a config file by path (the part before ':'), as config_flags does."""
    file = pathlib.Path(path)
    if not file.is_file():
        raise ConfigError(f"config file {path} does not exist")
    spec = importlib.util.spec_from_file_location(f"sweep_config_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def variants(config_arg: str) -> list[tuple[str, dict[str, Any], ml_collections.ConfigDict]]:
    """(name, overrides, resolved config) of every variant, each override validated against the config."""
    path, _, arg = config_arg.partition(":")
    module = load_config_module(path)
    if not hasattr(module, "get_sweep"):
        raise ConfigError(f"config file {path} defines no get_sweep(arg); add one returning a list of override dicts")
    out, seen = [], set()
    for i, override in enumerate(module.get_sweep(arg or None)):
        override = dict(override)
        name = override.pop("name", None)
        if not name or not NAME_PATTERN.match(name):
            raise ConfigError(f"{path}: sweep entry {i} needs a 'name' of letters, digits, '_.=-'; got {name!r}")
        if name in seen:
            raise ConfigError(f"{path}: sweep variant name {name!r} is used twice")
        seen.add(name)
        config = module.get_config(arg or None)
        for key, value in override.items():
            try:
                config.update_from_flattened_dict({key: value})
            except (KeyError, AttributeError) as e:
                raise ConfigError(f"{path}: sweep variant {name!r} overrides unknown key {key!r} ({e})") from e
            except TypeError as e:
                raise ConfigError(f"{path}: sweep variant {name!r}: {key}={value!r} has the wrong type ({e})") from e
        out.append((name, override, config))
    return out


def train_command(config_arg: str, workdir: pathlib.Path, name: str, overrides: dict[str, Any]) -> str:
    args = ["python", "train.py", f"--config={config_arg}", f"--workdir={workdir / name}"]
    args += [f"--config.{k}={v}" for k, v in overrides.items()]
    return shlex.join(args)


def run_variant(name: str, config: ml_collections.ConfigDict, workdir: pathlib.Path) -> dict[str, Any]:
    """Trains one variant (resuming if interrupted) and writes its result file; skips a finished one."""
    from transformer_jax.training.loop import train_and_evaluate

    result_path = workdir / RESULT_FILE
    if result_path.exists():
        result = json.loads(result_path.read_text())
        if result.get("num_steps") == config.train.num_steps:
            logging.info("sweep: %s already finished; skipping", name)
            return result
    start = time.time()
    train_and_evaluate(config, workdir)
    # Wall time of the attempt that finished (a resumed variant's earlier attempts are not counted).
    result = {"name": name, "num_steps": config.train.num_steps, "wall_s": time.time() - start}
    result_path.write_text(json.dumps(result))
    return result


def summarize_variant(name: str, overrides: dict, config: ml_collections.ConfigDict, run_dir: pathlib.Path) -> dict:
    """One results row from a variant's directory (empty fields where it has not run)."""
    import jax
    from flax import nnx

    from transformer_jax.model import build_model
    from transformer_jax.training.metrics import read_metrics

    model = nnx.eval_shape(lambda: build_model(config, rngs=nnx.Rngs(0)))
    row: dict[str, Any] = {
        "variant": name,
        "overrides": " ".join(f"{k}={v}" for k, v in overrides.items()) or "(none)",
        "parameters": sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param))),
        "steps": "",
        "valid_perplexity": "",
        "valid_bleu": "",
        "tokens_per_s": "",
        "wall_s": "",
    }
    metrics_file = run_dir / "metrics.jsonl"
    if metrics_file.exists():
        records = read_metrics(metrics_file)
        train = [r for r in records if "tokens_per_s" in r]
        if train:
            row["steps"] = train[-1]["step"]
            row["tokens_per_s"] = round(sum(r["tokens_per_s"] for r in train) / len(train), 1)
        for key, column in (("valid_perplexity", "valid_perplexity"), ("valid_bleu", "valid_bleu")):
            found = [r[key] for r in records if key in r]
            if found:
                row[column] = round(found[-1], 2)
    if (run_dir / RESULT_FILE).exists():
        row["wall_s"] = round(json.loads((run_dir / RESULT_FILE).read_text())["wall_s"], 1)
    return row


def write_results(rows: list[dict], workdir: pathlib.Path) -> None:
    """results.csv, results.md and results.png (validation perplexity and BLEU per variant)."""
    columns = list(rows[0])
    with open(workdir / "results.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(str(r[c]) for c in columns) + " |" for r in rows]
    (workdir / "results.md").write_text("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [r["variant"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, max(3, 0.35 * len(rows) + 1.5)), dpi=100)
    for ax, key, label in ((axes[0], "valid_perplexity", "validation perplexity"), (axes[1], "valid_bleu", "BLEU")):
        values = [r[key] if r[key] != "" else 0.0 for r in rows]
        ax.barh(names, values, color="tab:blue")
        ax.set_xlabel(label)
        ax.invert_yaxis()
    axes[1].set_yticklabels([])
    fig.tight_layout()
    fig.savefig(workdir / "results.png")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m transformer_jax.sweep", description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="configs/<file>.py[:arg] defining get_sweep(arg)")
    parser.add_argument("--workdir", required=True, help="one sub-directory per variant is made here")
    parser.add_argument("--dry_run", action="store_true", help="list the variants and their overrides, run nothing")
    parser.add_argument("--print_commands", action="store_true", help="print one train.py command per variant")
    parser.add_argument("--only", default=None, help="run only the variant with this name")
    parser.add_argument("--aggregate_only", action="store_true", help="only rebuild results.csv/md/png")
    args = parser.parse_args(argv)
    logging.getLogger().setLevel(logging.INFO)
    logging.getLogger("absl").setLevel(logging.WARNING)
    workdir = pathlib.Path(args.workdir)
    try:
        all_variants = variants(args.config)
        names = [name for name, _, _ in all_variants]
        if args.only is not None and args.only not in names:
            raise ConfigError(f"--only {args.only!r}: no such variant; the variants are {names}")
        chosen = [v for v in all_variants if args.only in (None, v[0])]
        if args.dry_run:
            for name, overrides, _ in chosen:
                print(f"{name}: {json.dumps(overrides)}")
            return 0
        if args.print_commands:
            for name, overrides, _ in chosen:
                print(train_command(args.config, workdir, name, overrides))
            return 0
        workdir.mkdir(parents=True, exist_ok=True)
        if not args.aggregate_only:
            for name, _, config in chosen:
                logging.info("sweep: variant %s", name)
                run_variant(name, config, workdir / name)
        rows = [summarize_variant(name, o, c, workdir / name) for name, o, c in all_variants]
        write_results(rows, workdir)
        print((workdir / "results.md").read_text())
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
