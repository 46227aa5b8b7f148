"""The training loop end to end on a tiny self-made corpus: metrics, exact resumption, preemption, failures."""

import json
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

from configs import common
from tests.helpers import REPO
from tests.helpers.training import synthetic_batch, tiny_train_config, wait_for_checkpoint
from transformer_jax import data, runtime
from transformer_jax.data import pipeline
from transformer_jax.errors import ConfigError, DataError
from transformer_jax.evaluation.translate import bleu_evaluator
from transformer_jax.model.layers import SpecialIds
from transformer_jax.sharding import batch_sharding, make_mesh
from transformer_jax.training import checkpoints, loop, metrics
from transformer_jax.training.loop import (
    NonFiniteError,
    check_batch_shapes,
    train_and_evaluate,
    validation_batches,
)
from transformer_jax.training.metrics import read_metrics
from transformer_jax.training.step import abstract_train_state, compile_steps, create_train_state


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory) -> pathlib.Path:
    workdir = tmp_path_factory.mktemp("uninterrupted")
    train_and_evaluate(tiny_train_config(corpus, bleu_every=6, bleu_sentences=5), workdir, bleu=bleu_evaluator)
    return workdir


def _train_losses(workdir: pathlib.Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(workdir / "metrics.jsonl") if "loss" in r}


def _final_params(workdir: pathlib.Path, config) -> list[np.ndarray]:
    _, abstract = abstract_train_state(config)
    step = checkpoints.list_steps(workdir)[-1]
    return [np.asarray(x) for x in jax.tree.leaves(checkpoints.load_model_params(workdir, step, abstract))]


def test_bleu_every_without_a_bleu_evaluator_is_refused_before_any_work(corpus, tmp_path):
    """Training cannot translate (it never imports evaluation): the caller passes the BLEU function."""
    with pytest.raises(ValueError, match=r"train\.bleu_every=6 .*bleu=transformer_jax\.evaluation\.translate"):
        train_and_evaluate(tiny_train_config(corpus, bleu_every=6), tmp_path / "run")
    assert not (tmp_path / "run").exists()


def test_metrics_are_logged_and_the_model_learns(uninterrupted):
    records = read_metrics(uninterrupted / "metrics.jsonl")
    train = [r for r in records if "loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "nll", "perplexity", "accuracy", "learning_rate", "tokens_per_s", "grad_norm", "mfu"):
        assert np.isfinite(train[-1][key]), key
    assert train[-1]["loss"] < train[0]["loss"]
    valid = [r for r in records if "valid_loss" in r]
    assert [r["step"] for r in valid] == [3, 6]
    bleu = [r for r in records if "valid_bleu" in r]
    assert [r["step"] for r in bleu] == [6] and 0 <= bleu[0]["valid_bleu"] <= 100
    assert "valid_tokenized_bleu" in bleu[0] and "valid_chrf" in bleu[0]
    assert any(p.name.startswith("events.out.tfevents") for p in (uninterrupted / "tensorboard").iterdir())
    assert checkpoints.list_steps(uninterrupted) == [3, 6]
    assert (uninterrupted / "spm.model").exists()


def test_resumed_run_equals_uninterrupted_run(corpus, uninterrupted, tmp_path):
    train_and_evaluate(tiny_train_config(corpus, num_steps=3), tmp_path)
    assert checkpoints.list_steps(tmp_path) == [3]
    train_and_evaluate(tiny_train_config(corpus), tmp_path)  # resumes from step 3
    assert _train_losses(tmp_path) == _train_losses(uninterrupted)  # exactly, not approximately
    config = tiny_train_config(corpus)
    for a, b in zip(_final_params(tmp_path, config), _final_params(uninterrupted, config), strict=True):
        np.testing.assert_array_equal(a, b)


def test_incompatible_checkpoint_lists_the_differing_keys(corpus, uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path / "run")
    config = tiny_train_config(corpus)
    config.model.d_ff = 128
    config.model.num_heads = 2
    with pytest.raises(checkpoints.CheckpointError, match=r"model.num_heads: 4 -> 2; model.d_ff: 64 -> 128"):
        train_and_evaluate(config, tmp_path / "run")


def test_damaged_latest_checkpoint_falls_back_to_the_previous(corpus, uninterrupted, tmp_path):
    shutil.copytree(uninterrupted, tmp_path / "run")
    for f in (tmp_path / "run" / "checkpoints" / "6" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 0:
            f.write_bytes(b"\0" * 7)
    config = tiny_train_config(corpus)
    graphs, abstract = abstract_train_state(config)
    shardings = jax.tree.map(lambda _: jax.sharding.SingleDeviceSharding(jax.devices()[0]), abstract)
    step, _, _ = checkpoints.Checkpointer(tmp_path / "run", config.ckpt).restore_latest(abstract, shardings, config)
    assert step == 3


def test_non_finite_losses_stop_the_run_with_a_checkpoint(corpus, tmp_path):
    config = tiny_train_config(corpus, num_steps=20, max_nonfinite_steps=2, eval_every=0)
    config.opt.learning_rate = 1e38  # the first update overflows the parameters; every later loss is NaN
    config.ckpt.every_steps = 100
    with pytest.raises(NonFiniteError, match="2 non-finite updates in a row"):
        train_and_evaluate(config, tmp_path)
    steps = checkpoints.list_steps(tmp_path)
    assert len(steps) == 1 and steps[0] < 20


def test_an_error_in_the_data_iterator_reaches_the_loop_as_itself(corpus, tmp_path, monkeypatch):
    error = DataError("the third batch cannot be read")
    original, calls = pipeline.WindowBatchIterator.__next__, []

    def failing_next(self):
        calls.append(1)
        if len(calls) == 3:
            raise error
        return original(self)

    monkeypatch.setattr(pipeline.WindowBatchIterator, "__next__", failing_next)
    with pytest.raises(DataError) as raised:
        train_and_evaluate(tiny_train_config(corpus, num_steps=6, eval_every=0), tmp_path)
    assert raised.value is error
    assert checkpoints.list_steps(tmp_path) == []  # not a clean stop: nothing is saved past the last checkpoint


def test_a_step_is_checkpointed_before_its_validation_runs(corpus, tmp_path, monkeypatch):
    def failing_validation(self, step, state):
        raise RuntimeError(f"validation failed at step {step}")

    monkeypatch.setattr(loop.Validation, "run_due", failing_validation)
    config = tiny_train_config(corpus, num_steps=1, eval_every=1)
    config.ckpt.every_steps = 1
    with pytest.raises(RuntimeError, match="validation failed at step 1"):
        train_and_evaluate(config, tmp_path)
    assert checkpoints.list_steps(tmp_path) == [1]  # the step's work survives a crash in its validation


def test_prefetched_batches_and_states_are_the_iterators_own(corpus, tmp_path):
    config = tiny_train_config(corpus)
    tokenizer = data.get_tokenizer(config.data, tmp_path, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    plain, _ = data.make_train_iterator(config.data, tokenizer)
    source, _ = data.make_train_iterator(config.data, tokenizer)
    prefetched = pipeline.prefetch(source, batch_sharding(make_mesh()))
    try:
        for _ in range(5):
            batch, real_tokens, shape = next(prefetched)
            expected = next(plain)
            for key, value in expected.items():
                np.testing.assert_array_equal(np.asarray(batch[key]), value)
            assert real_tokens == (plain.last_real_tokens, plain.last_corpus_tokens)
            assert shape == plain.last_global_shape
            assert prefetched.get_state() == plain.get_state()  # the state after this batch, not after the queue
    finally:
        prefetched.close()


def test_setup_builds_the_train_step_program_while_restoring_and_uses_the_kept_matmul_peak(
    corpus, uninterrupted, tmp_path, monkeypatch
):
    """A restart waits for the train step's program while the checkpoint is read, not after it (compile_ahead),
    the first step calls that program, and MFU divides by the peak kept beside the compilation cache."""
    shutil.copytree(uninterrupted, tmp_path / "run")
    directory = runtime.enable_compile_cache(str(tmp_path / "xla"))  # the test's own cache; the session's is back after
    (directory / metrics.PEAK_FILE).write_text(json.dumps({metrics.peak_key(): 3e9}))
    monkeypatch.setattr(metrics, "measure_matmul_peak", lambda: pytest.fail("measured the matmul peak again"))
    built = []

    def on_compile(event: str, seconds: float, fun_name: str = "?", **kwargs) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and fun_name == "jit(train_step)":
            built.append(threading.current_thread().name)

    for thread in threading.enumerate():  # an earlier test's setup that raised may still be compiling its step
        if thread.name == "compile_ahead":
            thread.join()
    jax.monitoring.register_event_duration_secs_listener(on_compile)
    run = loop.setup(tiny_train_config(corpus, num_steps=8, eval_every=0, peak_flops=0.0), tmp_path / "run")
    try:
        assert run.step == 6
        assert built == ["compile_ahead"]  # built (or loaded from the cache) before any step
        batch, _, _ = next(run.batches)
        jax.block_until_ready(run.train_step(run.state, batch))
        assert built == ["compile_ahead"]  # the first step called it: nothing built again
        assert run.metric_log.peak_all_devices == 3e9 * jax.device_count()
    finally:
        jax.monitoring.unregister_event_duration_listener(on_compile)
        run.close()
        runtime.enable_compile_cache()


def test_train_py_starts_without_importing_torch_or_the_decoder(tmp_path):
    """tensorboardX would import torch (1.5 s) when it is installed, and a run without validation BLEU never needs
    the decoder: neither is imported by train.py and its metric writer, and torch stays importable."""
    script = (
        "import sys, train\n"
        "from transformer_jax.training.metrics import MetricWriter\n"
        "MetricWriter(sys.argv[1]).close()\n"
        "print(sorted(m for m in ('torch', 'transformer_jax.decoding') if m in sys.modules), "
        "sys.modules.get('torch', 'absent') is not None)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "[] True", out.stdout
    assert list((tmp_path / "tensorboard").iterdir())  # the TensorBoard writer did open its event file


def _launch(corpus: pathlib.Path, workdir: pathlib.Path, num_steps: int) -> subprocess.Popen:
    overrides = {
        "data.text_dir": str(corpus),
        "train.num_steps": num_steps,
        "ckpt.every_steps": 10,
        "train.eval_every": 0,
        "train.log_every": 5,
    }
    args = [f"--config.{k}={v}" for k, v in overrides.items()]
    return subprocess.Popen(
        [
            sys.executable,
            str(REPO / "train.py"),
            "--config",
            str(REPO / "tests" / "tiny_train_config.py"),
            "--workdir",
            str(workdir),
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )


@pytest.mark.slow  # 30 s; test_resumed_run_equals_uninterrupted_run is the fast check of resuming
def test_killed_run_resumes_to_the_same_parameters(corpus, tmp_path):
    proc = _launch(corpus, tmp_path / "killed", 400)
    wait_for_checkpoint([proc], tmp_path / "killed", 10)
    proc.kill()  # SIGKILL: no chance to save anything more
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    steps = checkpoints.list_steps(tmp_path / "killed")
    assert steps and steps[-1] < 400, "the run finished before it was killed; make it longer"
    resumed = _launch(corpus, tmp_path / "killed", 40)
    assert resumed.wait(timeout=300) == 0, resumed.stdout.read()
    straight = _launch(corpus, tmp_path / "straight", 40)
    assert straight.wait(timeout=300) == 0, straight.stdout.read()
    # The killed run may have saved past 40 before dying; compare at step 40 where both have a checkpoint.
    config = tiny_train_config(corpus)
    _, abstract = abstract_train_state(config)
    a = checkpoints.load_model_params(tmp_path / "killed", 40, abstract)
    b = checkpoints.load_model_params(tmp_path / "straight", 40, abstract)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(x, y)


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(corpus, tmp_path):
    proc = _launch(corpus, tmp_path, 100_000)
    wait_for_checkpoint([proc], tmp_path, 10)
    proc.send_signal(signal.SIGTERM)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, output
    match = re.search(r"SIGTERM: saved the checkpoint at step (\d+)", output)
    assert match, output[-3000:]
    assert checkpoints.list_steps(tmp_path)[-1] == int(match.group(1)) >= 10  # saved where it stopped


# Slow: the default run's multi-device representative is test_checkpoint_faults' 1-to-4-device resume (fsdp).
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["data", "fsdp"])
def test_one_and_eight_devices_give_the_same_losses(mode):
    """Data parallel and FSDP over 8 simulated CPU devices train exactly like one device (float reduction order
    aside), with dropout on: its masks are a hash of each element's global index (model/layers.py), so they do not
    depend on how the batch is laid out over devices."""
    script = (
        "import json\n"
        "from tests.test_training_loop import losses_on\n"
        f"print(json.dumps(losses_on({mode!r}, dropout_rate=0.3)))\n"
    )
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=8", "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    eight = json.loads(out.stdout.strip().splitlines()[-1])
    one = losses_on("data", dropout_rate=0.3)  # test_dropout_only_in_train_mode checks that dropout acts
    np.testing.assert_allclose(eight, one, rtol=2e-5)


def losses_on(mode: str, dropout_rate: float = 0.0) -> list[float]:
    """Losses of 3 train steps on fixed batches, on every visible device."""
    config = common.base_config("tiny")
    config.model.vocab_size = 64
    config.model.num_encoder_layers = config.model.num_decoder_layers = 1  # depth adds only compile time
    config.model.dropout_rate = dropout_rate
    config.opt.warmup_steps = 1
    mesh = make_mesh()
    graphs, state = create_train_state(config)
    step, _, shardings = compile_steps(graphs, state, mesh, mode, label_smoothing=0.1, accum_steps=1)
    state = jax.device_put(state, shardings)
    if mesh.size > 1 and mode == "fsdp":
        table = nnx.to_pure_dict(state)["model"]["src_embed"]["table_VD"]
        assert len(table.sharding.device_set) == mesh.size  # really sharded, not replicated
    losses = []
    for seed in range(3):
        state, metrics = step(state, synthetic_batch(seed, rows=8, vocab=64))
        losses.append(float(metrics["loss_sum"]) / float(metrics["tokens"]))
    return losses


def test_validation_batches_keep_every_token_in_bucketed_lengths(corpus, tmp_path):
    config = tiny_train_config(corpus)
    config.data.eval_max_len = 256
    config.eval.batch_size = 5
    tokenizer = data.get_tokenizer(config.data, tmp_path, vocab_size=config.model.vocab_size, ids=SpecialIds.of(config))
    batches = validation_batches(config, tokenizer)
    pairs = data.load_split(config.data, config.data.valid_split)
    padded, _ = data.eval_batches(
        [s for s, _ in pairs], tokenizer, 5, 256, targets=[t for _, t in pairs]
    )  # fmt: skip
    padded = list(padded)
    for side in ("src", "tgt"):
        total = sum(int((b[f"{side}_segment_ids"] > 0).sum()) for b in batches)
        assert total == sum(int((b[f"{side}_segment_ids"] > 0).sum()) for b in padded)
        assert {b[f"{side}_segment_ids"].shape[1] for b in batches} <= {16, 32, 64, 128, 256}
    assert max(b["tgt_out"].shape[1] for b in batches) < 256  # short sentences are not padded to eval_max_len


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"data.batch_size": 12}, r"data.batch_size: 12 rows do not split into 2 micro-batches .* use a multiple of 8"),
        ({"eval.batch_size": 6}, r"eval.batch_size: validation batches of 6 rows do not split over 4 devices"),
    ],
)
def test_batches_that_do_not_split_over_the_devices_are_clear_errors(corpus, overrides, message):
    config = tiny_train_config(corpus)
    config.data.batch_size, config.train.grad_accum_steps = 16, 2
    config.eval.batch_size = 8
    for key, value in overrides.items():
        group, name = key.split(".")
        config[group][name] = value
    mesh = SimpleNamespace(size=4)  # 4 devices over all hosts
    with pytest.raises(ConfigError, match=message):
        check_batch_shapes(config, mesh)
    config.update({"data": {"batch_size": 16}, "eval": {"batch_size": 8}})
    assert check_batch_shapes(config, mesh) == 8  # lcm(8, 2 micro-batches x 4 devices)


def test_a_stop_before_the_first_step_saves_nothing_and_the_restart_trains(corpus, tmp_path):
    """A checkpoint at step 0 would hold no data-iterator position (no batch was drawn), and every restart would
    fail reading it: a stop that comes before any step saves nothing."""
    config = tiny_train_config(corpus, num_steps=2, eval_every=0)
    workdir = tmp_path / "run"
    run = loop.setup(config, workdir)
    try:
        stop = loop.StopRequest()
        stop.requested.set()
        loop.run_steps(run, stop)
    finally:
        run.close()
    assert checkpoints.list_steps(workdir) == []
    loop.train_and_evaluate(config, workdir)
    assert checkpoints.list_steps(workdir)[-1] == 2
