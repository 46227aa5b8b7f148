"""The training loop: config -> data -> jitted steps -> metrics and checkpoints, resumable exactly.

The Python loop never waits on the device for the step it just dispatched: metrics are fetched one step late,
batches are prepared and placed on the devices by a background thread.
"""

from __future__ import annotations

import json
import logging
import math
import pathlib
import queue
import signal
import threading
import time
from typing import Any

import jax
import ml_collections
import numpy as np

from transformer_jax import data
from transformer_jax.errors import ConfigError, NonFiniteError
from transformer_jax.evaluation.translate import bucket_length
from transformer_jax.model.spec import TransformerSpec
from transformer_jax.sharding import batch_sharding, make_mesh, state_shardings
from transformer_jax.training import flops
from transformer_jax.training.checkpoints import Checkpointer
from transformer_jax.training.losses import summarize
from transformer_jax.training.metrics import MetricWriter, Progress
from transformer_jax.training.optim import learning_rate_schedule
from transformer_jax.training.state import abstract_train_state, create_train_state
from transformer_jax.training.step import BATCH_KEYS, compile_steps

# With several hosts, every this many steps the hosts agree whether any of them got SIGTERM (one tiny all-gather):
# a launcher signals hosts at slightly different times, and a host that stopped alone would leave the others
# waiting in the next step's collectives. One host checks its flag every step.
STOP_CHECK_EVERY = 10


def should_stop(requested: bool, step: int) -> bool:
    """Whether to stop before `step` + 1; on several hosts, the same answer on every host."""
    if jax.process_count() == 1:
        return requested
    if step % STOP_CHECK_EVERY:
        return False
    from jax.experimental import multihost_utils

    return bool(np.any(multihost_utils.process_allgather(np.int32(requested))))


class Prefetcher:
    """Pulls batches (with the iterator state after each) on a thread and places them on the devices."""

    def __init__(self, iterator, sharding, depth: int = 2):
        self.iterator, self.sharding = iterator, sharding
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while not self.stop.is_set():
                batch = next(self.iterator)
                it_state = self.iterator.get_state()
                # Tokens and shape of the global batch (all hosts), for throughput and FLOPs.
                real, shape = self.iterator.last_real_tokens, self.iterator.last_global_shape
                placed = {k: place(batch[k], self.sharding) for k in BATCH_KEYS}
                self.queue.put((placed, it_state, real, shape))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which re-raises it
            self.queue.put(e)

    def next(self):
        item = self.queue.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        self.stop.set()
        while self.thread.is_alive():  # unblock a put()
            try:
                self.queue.get_nowait()
            except queue.Empty:
                self.thread.join(timeout=0.1)


def place(array: np.ndarray, sharding) -> jax.Array:
    """This host's rows of a global batch, placed on its devices (multi-host aware)."""
    return jax.make_array_from_process_local_data(sharding, np.asarray(array, np.int32))


def host_block(array: np.ndarray) -> np.ndarray:
    """This host's block of rows of a batch that every host holds whole (validation)."""
    rows = array.shape[0] // jax.process_count()
    return array[jax.process_index() * rows : (jax.process_index() + 1) * rows]


def validation_batches(config: ml_collections.ConfigDict, tokenizer) -> list[dict[str, np.ndarray]]:
    """Every validation pair once, sorted by length, each batch cut to its longest row rounded up to a bucket.

    Padding every batch to data.eval_max_len (256) made a Multi30k validation ~90 s on the CPU, mostly logits of
    padding; bucketed lengths (16, 32, 64, ...) keep the compiled shapes few. Loss sums do not depend on the order.
    """
    pairs = data.load_split(config.data, config.data.valid_split)
    pairs = sorted(pairs, key=lambda pair: (len(pair[1]), len(pair[0])))  # characters: a proxy for tokens
    batches, _ = data.eval_batches(
        [s for s, _ in pairs],
        tokenizer,
        config.eval.batch_size,
        config.data.eval_max_len,
        targets=[t for _, t in pairs],
    )
    out = []
    for b in batches:
        lengths = {
            side: bucket_length(int((b[f"{side}_segment_ids"] > 0).sum(1).max()), config.data.eval_max_len)
            for side in ("src", "tgt")
        }
        out.append({k: b[k][:, : lengths[k.split("_")[0]]] for k in BATCH_KEYS})
    return out


def validation_bleu(config, graphs, state, tokenizer, pairs) -> dict[str, float]:
    """sacreBLEU, tokenized BLEU and chrF of beam-search translations of a bounded validation subset."""
    from flax import nnx

    from transformer_jax.evaluation.bleu import score_all
    from transformer_jax.evaluation.translate import translate

    model = nnx.merge(graphs.eval, state)[0]
    hypotheses, _ = translate(
        model,
        tokenizer,
        [s for s, _ in pairs],
        beam_size=config.eval.beam_size,
        alpha=config.eval.alpha,
        max_extra_len=config.eval.max_extra_len,
        batch_size=config.eval.batch_size,
        max_input_len=config.data.eval_max_len,
    )
    scores = score_all(hypotheses, [t for _, t in pairs])
    return {name: float(value["score"]) for name, value in scores.items()}


def evaluate_loss(eval_step, state, batches, sharding) -> dict[str, float]:
    totals: dict[str, Any] = {}
    for batch in batches:
        sums = eval_step(state, {k: place(host_block(v), sharding) for k, v in batch.items()})
        totals = sums if not totals else jax.tree.map(lambda a, b: a + b, totals, sums)
    return summarize(jax.device_get(totals))


class _Window:
    """Host-side sums of the metrics of the steps since the last log line."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sums = {"loss_sum": 0.0, "nll_sum": 0.0, "correct": 0.0, "tokens": 0.0}
        self.grad_norms, self.real_tokens, self.flops, self.steps, self.start = [], 0, 0.0, 0, time.time()

    def add(self, metrics: dict, real_tokens: int, step_flops: float) -> None:
        for k in self.sums:
            self.sums[k] += float(metrics[k])
        if metrics["finite"]:
            self.grad_norms.append(float(metrics["grad_norm"]))
        self.real_tokens += real_tokens
        self.flops += step_flops
        self.steps += 1


def check_batch_shapes(config: ml_collections.ConfigDict, mesh) -> int:
    """Every batch must split into grad_accum_steps micro-batches, each split over the devices (of all hosts).

    Returns the multiple that bucketed batches' (global) row counts are rounded to so that they always do.
    """
    accum = config.train.grad_accum_steps
    if accum < 1:
        raise ConfigError(f"config key train.grad_accum_steps: must be >= 1, got {accum}")
    if config.data.batching != "bucket" and config.data.batch_size % (accum * mesh.size):
        raise ConfigError(
            f"config key data.batch_size: {config.data.batch_size} rows do not split into {accum} micro-batches "
            f"(train.grad_accum_steps) over {mesh.size} devices; use a multiple of {accum * mesh.size}"
        )
    if config.train.eval_every and config.eval.batch_size % mesh.size:
        raise ConfigError(
            f"config key eval.batch_size: validation batches of {config.eval.batch_size} rows do not split over "
            f"{mesh.size} devices; use a multiple of {mesh.size}"
        )
    return math.lcm(8, accum * mesh.size)


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str | pathlib.Path) -> dict[str, float]:
    """Trains (or resumes) in workdir until config.train.num_steps; returns the last logged metrics."""
    workdir = pathlib.Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    mesh = make_mesh()
    row_multiple = check_batch_shapes(config, mesh)
    spec = TransformerSpec.from_config(config)

    tokenizer = data.get_tokenizer(
        config.data, workdir, vocab_size=config.model.vocab_size, train_if_missing=jax.process_count() == 1
    )
    train_iter, data_stats = data.make_train_iterator(config.data, tokenizer, row_multiple=row_multiple)
    graphs, abstract = abstract_train_state(config)
    shardings = state_shardings(abstract, mesh, config.train.mesh)
    checkpointer = Checkpointer(workdir, config.ckpt)
    restored = checkpointer.restore_latest(abstract, shardings, config)
    if restored is None:
        state = jax.jit(lambda: create_train_state(config)[1], out_shardings=shardings)()
        step = 0
    else:
        step, state, it_state = restored
        train_iter.set_state(it_state)
        logging.info("resumed from the checkpoint at step %d in %s", step, workdir)
    train_step, eval_step, _ = compile_steps(
        graphs,
        abstract,
        mesh,
        config.train.mesh,
        label_smoothing=config.train.label_smoothing,
        accum_steps=config.train.grad_accum_steps,
    )
    schedule = learning_rate_schedule(config.opt, config.train.num_steps)
    valid = validation_batches(config, tokenizer) if config.train.eval_every else []
    bleu_pairs = (
        data.load_split(config.data, config.data.valid_split)[: config.train.bleu_sentences]
        if config.train.bleu_every
        else []
    )
    peak = config.train.peak_flops or flops.measure_matmul_peak()
    writer = MetricWriter(workdir)
    writer.write(step, {f"data_{k}": v for k, v in data_stats.items() if isinstance(v, int)})

    stop_requested = threading.Event()
    previous_handler = signal.signal(signal.SIGTERM, lambda *_: stop_requested.set())
    sharding = batch_sharding(mesh)
    prefetcher = Prefetcher(train_iter, sharding)
    progress = Progress(step, config.train.num_steps)
    window, pending, last_logged, saved_step, it_state = _Window(), None, {}, step, None

    def drain(entry) -> None:
        """Fetch one finished step's metrics (the host sync happens one step late)."""
        metrics, real, step_flops, at_step = entry
        metrics = jax.device_get(metrics)
        window.add(metrics, real, step_flops)
        if int(metrics["nonfinite_in_a_row"]) >= config.train.max_nonfinite_steps:
            raise NonFiniteError(
                f"{int(metrics['nonfinite_in_a_row'])} non-finite updates in a row at step {at_step} "
                f"(train.max_nonfinite_steps={config.train.max_nonfinite_steps}); the last good state is saved"
            )

    def log(at_step: int) -> dict[str, float]:
        elapsed = max(time.time() - window.start, 1e-9)
        metrics = summarize(window.sums)
        metrics.update(
            learning_rate=float(schedule(at_step - 1)),
            grad_norm=float(np.mean(window.grad_norms)) if window.grad_norms else float("nan"),
            tokens_per_s=window.real_tokens / elapsed,
            steps_per_s=window.steps / elapsed,
            mfu=window.flops / elapsed / (peak * mesh.size),
        )
        writer.write(at_step, metrics)
        progress.update(at_step, metrics)
        window.reset()
        return metrics

    stopping = False
    try:
        while step < config.train.num_steps:
            stopping = should_stop(stop_requested.is_set(), step)
            if stopping:
                break
            batch, it_state, real, shape = prefetcher.next()
            state, metrics = train_step(state, batch)
            step += 1
            if pending is not None:
                drain(pending)
            pending = (metrics, real, flops.train_step_flops(spec, *shape), step)
            if step % config.train.log_every == 0 or step == config.train.num_steps:
                drain(pending)
                pending = None
                last_logged = log(step)
            if config.train.eval_every and (step % config.train.eval_every == 0 or step == config.train.num_steps):
                valid_metrics = evaluate_loss(eval_step, state, valid, sharding)
                writer.write(step, valid_metrics, prefix="valid_")
                logging.info("step %d validation: %s", step, json.dumps(valid_metrics))
            if config.train.bleu_every and (step % config.train.bleu_every == 0 or step == config.train.num_steps):
                bleu = validation_bleu(config, graphs, state, tokenizer, bleu_pairs)
                writer.write(step, bleu, prefix="valid_")
                logging.info("step %d validation BLEU on %d sentences: %s", step, len(bleu_pairs), json.dumps(bleu))
            if step % config.ckpt.every_steps == 0 or step == config.train.num_steps:
                checkpointer.save(step, state, it_state, config)
                saved_step = step
        if pending is not None:
            drain(pending)
        if stopping and saved_step != step:
            checkpointer.save(step, state, it_state, config)
    except NonFiniteError:
        # Non-finite updates were skipped, so the state is the last good one.
        checkpointer.save(step, state, it_state, config)
        raise
    finally:
        if stopping:
            logging.warning("SIGTERM: saved the checkpoint at step %d; exiting", step)
        signal.signal(signal.SIGTERM, previous_handler)
        prefetcher.close()
        progress.close()
        checkpointer.close()
        writer.close()
    return last_logged
