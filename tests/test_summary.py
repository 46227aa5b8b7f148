"""`train.py --dry_run`: batch shapes are the ones training uses, and FLOPs do not grow with gradient accumulation."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests.helpers import REPO
from tests.helpers.training import tiny_train_config
from transformer_jax import data
from transformer_jax.model import TransformerSpec
from transformer_jax.model.layers import SpecialIds
from transformer_jax.sharding import make_mesh
from transformer_jax.training.loop import check_batch_shapes, dry_run_summary
from transformer_jax.training.metrics import train_step_flops


def _config(corpus: pathlib.Path, batching: str, accum: int = 1):
    config = tiny_train_config(corpus, grad_accum_steps=accum)
    config.data.batching = batching
    config.data.batch_size = 16
    config.data.tokens_per_batch = 256
    return config


def test_accumulation_splits_the_same_batch_so_flops_and_tokens_do_not_change(corpus):
    one, four = dry_run_summary(_config(corpus, "pack")), dry_run_summary(_config(corpus, "pack", accum=4))
    assert four["batch_shapes_rows_src_tgt"] == one["batch_shapes_rows_src_tgt"] == [(16, 32, 32)]
    spec = TransformerSpec.from_config(_config(corpus, "pack"))
    assert four["train_flops_per_step"] == one["train_flops_per_step"] == train_step_flops(spec, 16, 32, 32)
    assert four["tokens_per_step_per_side"] == one["tokens_per_step_per_side"] == 16 * 32


@pytest.mark.parametrize("batching", ["pack", "bucket", "pad"])
@pytest.mark.parametrize("accum", [1, 4])
def test_shapes_are_the_ones_the_data_pipeline_produces(corpus, tmp_path_factory, batching, accum):
    config = _config(corpus, batching, accum)
    shapes = dry_run_summary(config)["batch_shapes_rows_src_tgt"]
    tokenizer = data.get_tokenizer(
        config.data, corpus.parent, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config)
    )
    # The row multiple training asks for: bucket rows must split into accum micro-batches over the devices.
    row_multiple = check_batch_shapes(config, make_mesh())
    iterator, stats = data.make_train_iterator(config.data, tokenizer, row_multiple=row_multiple)
    assert shapes == stats["batch_shapes"]
    produced = set()
    for _ in range(40):
        batch = next(iterator)
        produced.add((batch["src_tokens"].shape[0], batch["src_tokens"].shape[1], batch["tgt_in"].shape[1]))
    assert produced <= set(shapes)
    if batching == "bucket":
        assert len(produced) > 1 and all(rows % accum == 0 for rows, _, _ in produced)
    else:
        assert produced == set(shapes)


# In-process: test_accumulation_splits_the_same_batch_so_flops_and_tokens_do_not_change (dry_run_summary's shapes and
# FLOPs under grad_accum_steps=4); train.py --dry_run printing it as JSON: tests/test_finetune.py's
# test_dry_run_and_plan_size_the_source_model_without_reading_its_parameters.
@pytest.mark.slow
def test_dry_run_prints_the_summary_as_json(corpus):
    args = ["--config", str(REPO / "tests" / "tiny_train_config.py"), f"--config.data.text_dir={corpus}"]
    out = subprocess.run(
        [sys.executable, str(REPO / "train.py"), *args, "--config.train.grad_accum_steps=4", "--dry_run"],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    summary = json.loads(out.stdout)
    config = tiny_train_config(corpus)
    rows, length = config.data.batch_size, config.data.max_len
    assert summary["batch_shapes_rows_src_tgt"] == [[rows, length, length]]
    spec = TransformerSpec.from_config(config)
    assert summary["train_flops_per_step"] == pytest.approx(train_step_flops(spec, rows, length, length))
