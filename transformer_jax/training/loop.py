"""The training loop: config -> data -> jitted steps -> metrics and checkpoints, resumable exactly.

The loop never waits on the device for the step it just dispatched: metrics are fetched one step late, batches
are placed on the devices by grain's prefetch thread. With ckpt.keep_best or train.early_stop_patience every
validation is ranked by train.select_metric (training.bookkeeping): an improvement saves a checkpoint, and
train.early_stop_patience validations without one stop the run. Validation BLEU sits above training: the caller
passes it as a function (`BleuEvaluator`), so training never imports evaluation.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import pathlib
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import grain
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils

from transformer_jax import runtime
from transformer_jax.data import languages
from transformer_jax.data.batching import BATCH_KEYS, padded_eval_length
from transformer_jax.data.languages import validation_directions
from transformer_jax.data.pipeline import (
    batch_shapes,
    eval_batches,
    make_train_iterator,
    multilingual_examples,
    place,
    prefetch,
)
from transformer_jax.data.sources import load_split, validation_sets
from transformer_jax.data.store import open_train_examples
from transformer_jax.data.tokenizer import model_tokenizer
from transformer_jax.errors import ConfigError, NonFiniteError
from transformer_jax.model import TransformerSpec, parameter_count
from transformer_jax.model.lora import BASE, LoRASpec
from transformer_jax.runtime import Progress
from transformer_jax.sharding import batch_sharding, make_mesh, tracing_mesh
from transformer_jax.training import add_languages, bookkeeping, checkpoints, init_from
from transformer_jax.training.checkpoints import Checkpointer
from transformer_jax.training.metrics import MetricWriter, forward_flops, matmul_peak, train_step_flops
from transformer_jax.training.step import (
    Graphs,
    abstract_train_state,
    compile_steps,
    create_train_state,
    eval_model,
    summarize,
)

# (config, tokenizer) -> a function of the model in eval mode that returns {metric name: score}: validation BLEU,
# chrF, chrF++ and TER of data.valid_split, and `NAME_bleu`... of each eval.extra_valid set.
BleuEvaluator = Callable[[ml_collections.ConfigDict, Any], Callable[[Any], dict[str, float]]]

# With several hosts, every this many steps the hosts agree whether any of them got SIGTERM (one tiny all-gather):
# a launcher signals hosts at slightly different times, and a host that stopped alone would leave the others
# waiting in the next step's collectives. One host checks its flag every step.
STOP_CHECK_EVERY = 10


def host_block(array: np.ndarray) -> np.ndarray:
    """This host's block of rows of a batch that every host holds whole (validation)."""
    rows = array.shape[0] // jax.process_count()
    return array[jax.process_index() * rows : (jax.process_index() + 1) * rows]


def validation_batches(
    config: ml_collections.ConfigDict,
    tokenizer,
    pairs: list[tuple[str, str]] | None = None,
    direction: languages.Direction | None = None,
) -> list[dict[str, np.ndarray]]:
    """Every validation pair once (default data.valid_split's), sorted by length, each batch cut to its longest row
    rounded up to a bucket (16, 32, 64, ...: few compiled shapes, little padding; sums ignore order). The pairs of a
    multilingual run's `direction` carry its language ids as its training batches do (languages.Placement)."""
    if pairs is None:
        pairs = load_split(config.data, config.data.valid_split)
    pairs = sorted(pairs, key=lambda pair: (len(pair[1]), len(pair[0])))  # characters: a proxy for tokens
    prefixes = {}
    if direction is not None:
        placement = languages.Placement.of(config)
        prefixes = {
            "source_prefix": placement.source_prefix(direction),
            "target_prefix": placement.target_prefix(direction),
        }
    batches, _ = eval_batches(
        [s for s, _ in pairs],
        tokenizer,
        config.eval.batch_size,
        config.data.eval_max_len,
        targets=[t for _, t in pairs],
        **prefixes,
    )
    out = []
    for b in batches:
        lengths = {
            side: padded_eval_length(int((b[f"{side}_segment_ids"] > 0).sum(1).max()), config.data.eval_max_len)
            for side in ("src", "tgt")
        }
        out.append({k: b[k][:, : lengths[k.split("_")[0]]] for k in BATCH_KEYS})
    return out


def evaluate_loss(eval_step, state, batches, sharding) -> dict[str, float]:
    totals: dict[str, Any] = {}
    for batch in batches:
        sums = eval_step(state, {k: place(host_block(v), sharding) for k, v in batch.items()})
        totals = sums if not totals else jax.tree.map(lambda a, b: a + b, totals, sums)
    return summarize(jax.device_get(totals))


def check_batch_shapes(config: ml_collections.ConfigDict, mesh) -> int:
    """Every batch must split into grad_accum_steps micro-batches, each split over the devices (of all hosts).
    Returns the multiple that bucketed batches' (global) row counts are rounded to so that they always do."""
    accum = config.train.grad_accum_steps  # >= 1 (the schema's check)
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


def dry_run_summary(config: ml_collections.ConfigDict) -> dict:
    """`train.py --dry_run`: parameters, FLOPs, batch shapes, mesh and a time estimate, without data or compute.
    Gradient accumulation splits the same batch, so it changes neither FLOPs nor tokens."""
    spec = TransformerSpec.from_config(config)
    mesh = make_mesh()
    shapes = batch_shapes(config.data, jax.process_count(), check_batch_shapes(config, mesh))
    # FLOPs per target token at the longest shape, and per step for the largest batch by tokens.
    rows, s_len, t_len = max(shapes, key=lambda s: s[0] * s[1])
    forward = forward_flops(spec, rows, s_len, t_len)
    step = train_step_flops(spec, rows, s_len, t_len)
    summary = {
        "parameters": parameter_count(config),
        "forward_flops_per_target_token": forward / (rows * t_len),
        "train_flops_per_target_token": 3 * forward / (rows * t_len),
        "train_flops_per_step": step,
        "batch_shapes_rows_src_tgt": shapes,
        "tokens_per_step_per_side": rows * s_len,
        "mesh": {"axes": dict(mesh.shape), "devices": [str(d) for d in mesh.devices.flat], "mode": config.train.mesh},
    }
    devices = config.train.estimate_devices or mesh.size
    if config.train.peak_flops:
        step_s = step / (config.train.peak_flops * devices * config.train.assumed_mfu)
        summary["estimate"] = {
            "devices": devices,
            "peak_flops_per_device": config.train.peak_flops,
            "assumed_mfu": config.train.assumed_mfu,
            "step_s": step_s,
            "total_hours": step_s * config.train.num_steps / 3600,
        }
    else:
        summary["estimate"] = "set --config.train.peak_flops (FLOP/s of one device) for a time estimate"
    return summary


def is_due(step: int, every: int, last_step: int) -> bool:
    """Whether something done every `every` steps (0: never) and at the last step is due after `step`."""
    return bool(every) and (step % every == 0 or step == last_step)


class StopRequest:
    """SIGTERM sets a flag instead of killing the process (while inside `with`); `due` says when to stop."""

    def __init__(self):
        self.requested = threading.Event()
        self._previous = None

    def __enter__(self) -> StopRequest:
        self._previous = signal.signal(signal.SIGTERM, lambda *_: self.requested.set())
        return self

    def __exit__(self, *exc) -> None:
        signal.signal(signal.SIGTERM, self._previous)

    def due(self, step: int) -> bool:
        """Whether to stop before `step` + 1; on several hosts, the same answer on every host."""
        if jax.process_count() == 1:
            return self.requested.is_set()
        if step % STOP_CHECK_EVERY:
            return False
        return bool(np.any(multihost_utils.process_allgather(np.int32(self.requested.is_set()))))


class MetricLog:
    """The train metrics: fetched one step late, summed on the host, written every train.log_every steps.
    Fetching raises NonFiniteError after train.max_nonfinite_steps non-finite updates in a row."""

    def __init__(
        self,
        config: ml_collections.ConfigDict,
        writer: MetricWriter,
        progress: Progress,
        peak: float,
        learning_rate: Callable[[int], Any],
    ):
        self.writer, self.progress = writer, progress
        self.schedule = learning_rate
        self.max_nonfinite = config.train.max_nonfinite_steps
        self.peak_all_devices = peak * jax.device_count()
        self.pending: tuple | None = None  # (metrics on device, real tokens, FLOPs, step) of the last step
        self._reset()

    def _reset(self) -> None:
        self.sums = {"loss_sum": 0.0, "nll_sum": 0.0, "correct": 0.0, "tokens": 0.0}
        self.grad_norms, self.real_tokens, self.flops, self.steps, self.start = [], 0, 0.0, 0, time.time()
        self.corpus_tokens: Counter[str] = Counter()  # data.corpora: tokens_NAME, each corpus's share of them

    def add(self, metrics: dict, real_tokens: tuple[int, dict[str, int]], step_flops: float, step: int) -> None:
        """Takes the step just dispatched (real tokens: all, per corpus); fetches the one before."""
        self.flush()
        self.pending = (metrics, real_tokens, step_flops, step)

    def flush(self) -> None:
        if self.pending is None:
            return
        metrics, real_tokens, step_flops, step = self.pending
        self.pending = None
        metrics = jax.device_get(metrics)
        for k in self.sums:
            self.sums[k] += float(metrics[k])
        if metrics["finite"]:
            self.grad_norms.append(float(metrics["grad_norm"]))
        self.real_tokens += real_tokens[0]
        self.corpus_tokens.update(real_tokens[1])
        self.flops += step_flops
        self.steps += 1
        if int(metrics["nonfinite_in_a_row"]) >= self.max_nonfinite:
            raise NonFiniteError(
                f"{int(metrics['nonfinite_in_a_row'])} non-finite updates in a row at step {step} "
                f"(train.max_nonfinite_steps={self.max_nonfinite}); the state before them is saved unless it holds "
                "non-finite values itself (then the last finite checkpoint stays the latest)"
            )

    def write(self, step: int) -> dict[str, float]:
        """Writes and returns one record of the steps since the last."""
        self.flush()
        elapsed = max(time.time() - self.start, 1e-9)
        metrics = summarize(self.sums)
        metrics.update(
            learning_rate=float(self.schedule(step - 1)),
            grad_norm=float(np.mean(self.grad_norms)) if self.grad_norms else float("nan"),
            tokens_per_s=self.real_tokens / elapsed,
            steps_per_s=self.steps / elapsed,
            mfu=self.flops / elapsed / self.peak_all_devices,
            **{f"tokens_{name}": count for name, count in self.corpus_tokens.items()},
        )
        self.writer.write(step, metrics)
        self.progress.set(step, **{k: metrics[k] for k in ("loss", "learning_rate", "tokens_per_s")})
        self._reset()
        return metrics


def decodes_at_validation(config: ml_collections.ConfigDict) -> bool:
    """Whether every train.eval_every validation decodes: the ranked select metric is a score of translations."""
    return bookkeeping.is_tracked(config) and config.train.select_metric in bookkeeping.DECODED


def mean_over_directions(per_direction: list[dict[str, float]]) -> dict[str, float]:
    """Each score's unweighted mean over a multilingual run's directions: every direction counts the same, however
    many pairs or tokens it has (the valid_* that train.select_metric and early stopping rank)."""
    return {k: float(np.mean([scores[k] for scores in per_direction])) for k in per_direction[0]}


class Validation:
    """Validation loss every train.eval_every steps, BLEU every train.bleu_every steps (and at the last step) and at
    every eval_every when the ranked select metric needs translations; eval.extra_valid sets too (valid_NAME_*).

    A multilingual run (data.directions) validates every direction on its lines of the multi-way folder:
    valid_<src>-<tgt>_* per direction and their unweighted mean as valid_* (what select_metric ranks). Each
    validation then scores directions x the valid split's lines (12 directions of Multi30k: 12 x 1,014 pairs), and
    BLEU translates directions x train.bleu_sentences (translate.direction_bleu_evaluator)."""

    def __init__(
        self, config, graphs: Graphs, tokenizer, eval_step, sharding, writer: MetricWriter, bleu: BleuEvaluator | None
    ):
        self.config, self.graphs = config, graphs
        self.eval_step, self.sharding, self.writer = eval_step, sharding, writer
        self.multilingual = bool(config.data.directions)
        if self.multilingual:
            directions = validation_directions(config) if config.train.eval_every else []
            self.batches = [(d.name, validation_batches(config, tokenizer, pairs, d)) for d, pairs in directions]
        else:
            sets = validation_sets(config) if config.train.eval_every else []
            self.batches = [(name, validation_batches(config, tokenizer, pairs)) for name, pairs in sets]
        self.decodes = decodes_at_validation(config)
        self.bleu = bleu(config, tokenizer) if config.train.bleu_every or self.decodes else None

    def run_due(self, step: int, state) -> dict[str, float]:
        """Runs what is due after `step`; returns every score written, named as in metrics.jsonl (valid_*)."""
        train, num_steps = self.config.train, self.config.train.num_steps
        scores: dict[str, float] = {}
        validating = is_due(step, train.eval_every, num_steps)
        if validating:
            per_set = []
            for name, batches in self.batches:
                metrics = evaluate_loss(self.eval_step, state, batches, self.sharding)
                prefix = f"valid_{name}_" if name else "valid_"
                self.writer.write(step, metrics, prefix=prefix)
                scores.update({prefix + k: v for k, v in metrics.items()})
                logging.info("step %d validation%s: %s", step, f" ({name})" if name else "", json.dumps(metrics))
                per_set.append(metrics)
            if self.multilingual:
                mean = mean_over_directions(per_set)
                self.writer.write(step, mean, prefix="valid_")
                scores.update({f"valid_{k}": v for k, v in mean.items()})
                logging.info("step %d validation (mean over directions): %s", step, json.dumps(mean))
        if is_due(step, train.bleu_every, num_steps) or (self.decodes and validating):
            bleu = self.bleu(eval_model(self.graphs, state))
            self.writer.write(step, bleu, prefix="valid_")
            scores.update({f"valid_{k}": v for k, v in bleu.items()})
            logging.info("step %d validation BLEU: %s", step, json.dumps(bleu))
        return scores


@dataclasses.dataclass
class TrainingRun:
    """What `setup` builds from the config: the state to start from and everything the step loop uses."""

    config: ml_collections.ConfigDict
    spec: TransformerSpec
    mesh: jax.sharding.Mesh
    state: Any  # nnx.State of the TrainState, placed with its shardings
    step: int  # optimizer steps already taken
    train_step: Callable
    batches: grain.DatasetIterator  # `prefetch`: (placed batch, real tokens, global shape)
    checkpointer: Checkpointer
    metric_log: MetricLog
    validation: Validation
    writer: MetricWriter
    progress: Progress
    record: bookkeeping.SelectionRecord  # the best validation so far, early stopping's count (restored with the state)

    def close(self) -> None:
        self.batches.close()
        self.progress.close()
        self.checkpointer.close()
        self.writer.close()


def setup(
    config: ml_collections.ConfigDict,
    workdir: pathlib.Path,
    bleu: BleuEvaluator | None = None,
    init_params: dict | None = None,
    source_step: int | None = None,
) -> TrainingRun:
    """The run from its latest checkpoint, or new (with `init_params`, a fine-tuning source's of `source_step`,
    init_from.prepare). Under LoRA the base's parameters are the source's, read again on a restart (checked against
    the checkpoint's base record)."""
    workdir.mkdir(parents=True, exist_ok=True)
    mesh = make_mesh()
    logging.info("training on %d devices, mesh %s, train.mesh=%s", mesh.size, dict(mesh.shape), config.train.mesh)
    row_multiple = check_batch_shapes(config, mesh)
    spec = TransformerSpec.from_config(config)
    tokenizer = model_tokenizer(config, workdir, train_if_missing=jax.process_count() == 1)
    examples = None  # data.store=False: tokenized in memory by make_train_iterator
    if config.data.directions:
        examples = multilingual_examples(config, tokenizer, build_if_missing=jax.process_count() == 1)
    elif config.data.store:
        examples, _ = open_train_examples(config.data, tokenizer, build_if_missing=jax.process_count() == 1)
    train_iter, data_stats = make_train_iterator(config.data, tokenizer, examples=examples, row_multiple=row_multiple)
    graphs, abstract = abstract_train_state(config)
    train = config.train
    train_step, eval_step, shardings = compile_steps(
        graphs, abstract, mesh, train.mesh, label_smoothing=train.label_smoothing, accum_steps=train.grad_accum_steps
    )
    sharding = batch_sharding(mesh)
    shapes = batch_shapes(config.data, jax.process_count(), row_multiple)
    ahead = compile_ahead(train_step, abstract, shardings, shapes, sharding, mesh)
    checkpointer = Checkpointer(
        workdir, config.ckpt, config.train.select_metric if bookkeeping.is_tracked(config) else None
    )
    restored = checkpointer.restore_latest(abstract, shardings, config)
    lora = LoRASpec.of(config) is not None
    if restored is None:
        state = jax.jit(lambda: create_train_state(config)[1], out_shardings=shardings)()
        step = 0
        if lora:  # saved with every checkpoint
            source = add_languages.source_part(init_params, config)  # the source's, as its record covers
            checkpointer.base = checkpoints.base_record(config.train.init_from, source_step, source)
    else:
        step, state, it_state = restored
        train_iter.set_state(it_state)
        logging.info("resumed from the checkpoint at step %d in %s", step, workdir)
        where = f"the checkpoint at step {step} in {checkpoints.checkpoint_dir(workdir)}"
        init_params = add_languages.load_base(config, checkpointer.base, abstract, where) if lora else None
    if init_params is not None:  # a fine-tuning source's model parameters (a pure dict), or a LoRA run's base
        param_shardings = nnx.to_pure_dict(nnx.filter_state(shardings["model"], BASE))
        nnx.replace_by_pure_dict(state["model"], jax.device_put(init_params, param_shardings))
    # Written only once the checkpoint is accepted: a refused restart leaves the workdir as it was.
    if jax.process_index() == 0:
        (workdir / "config.json").write_text(config.to_json_best_effort(indent=2))
    writer = MetricWriter(workdir, resume_step=step, config=config)
    validation = Validation(config, graphs, tokenizer, eval_step, sharding, writer, bleu)
    ahead.join()  # before the matmul peak is timed, and so that the first step finds the program
    peak = config.train.peak_flops or matmul_peak(runtime.compile_cache_directory())
    writer.write(step, {f"data_{k}": v for k, v in data_stats.items() if isinstance(v, int)})
    progress = Progress(config.train.num_steps, "step", "steps", initial=step, enabled=jax.process_index() == 0)
    return TrainingRun(
        config=config,
        spec=spec,
        mesh=mesh,
        state=state,
        step=step,
        train_step=train_step,
        batches=prefetch(train_iter, sharding),
        checkpointer=checkpointer,
        metric_log=MetricLog(config, writer, progress, peak, graphs.learning_rate),
        validation=validation,
        writer=writer,
        progress=progress,
        record=bookkeeping.SelectionRecord.from_json(checkpointer.selection, config.train.select_metric),
    )


def abstract_batch(rows: int, src_len: int, tgt_len: int, sharding=None) -> dict[str, jax.ShapeDtypeStruct]:
    """The shapes and dtypes of a global batch of `rows` rows, S=src_len, T=tgt_len."""
    shape = {"src": (rows, src_len), "tgt": (rows, tgt_len)}
    return {k: jax.ShapeDtypeStruct(shape[k[:3]], jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def compile_ahead(train_step, abstract_state, shardings, shapes, batch_sharding_, mesh) -> threading.Thread:
    """Compiles (or loads from the compilation cache) the train step on a thread while the checkpoint is restored
    (file waits and numpy checksums leave the GIL free), if the data has one global batch shape: the program the
    first step calls, handed over by jax's caches. A failure costs only its time: the first step compiles again."""

    def work() -> None:
        batch = abstract_batch(*shapes[0], sharding=batch_sharding_)
        state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), abstract_state, shardings)
        try:
            with tracing_mesh(mesh):  # as the step loop traces it (a context of this thread only)
                train_step.lower(state, batch).compile()
        except Exception as error:  # the first step compiles again and reports a real problem itself
            logging.info("compiling the train step ahead failed (%s); it compiles at the first step", error)

    # Not a daemon: a run that stops with an error before the first step exits once the thread is done, never
    # while XLA still compiles (jax's exit handler tears the backend down).
    thread = threading.Thread(target=work if len(shapes) == 1 else lambda: None, name="compile_ahead")
    thread.start()
    return thread


@jax.jit
def _all_finite(state) -> jax.Array:
    """Whether every floating-point array of the state is finite (one device reduction)."""
    leaves = [x for x in jax.tree.leaves(state) if jnp.issubdtype(x.dtype, jnp.inexact)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


def save_if_finite(
    run: TrainingRun, step: int, state, it_state, rotate: bool = True, metrics: dict[str, float] | None = None
) -> bool:
    """Saves a checkpoint (with the selection record, and `metrics`, the validation scores that rank it) unless the
    state holds a NaN or infinity: such a state must neither become the latest checkpoint nor make ckpt.keep rotate
    away the last finite one. rotate=False keeps every older checkpoint."""
    if not bool(_all_finite(state)):
        steps = run.checkpointer.manager.all_steps()
        logging.error(
            "not saving the checkpoint of step %d: the state holds non-finite values; the last finite checkpoint is %s",
            step,
            f"step {max(steps)}" if steps else "none",
        )
        return False
    run.checkpointer.save(
        step, state, it_state, run.config, rotate=rotate, metrics=metrics, selection_record=run.record.to_json()
    )
    return True


STOPPED_EARLY_AT = "stopped_early_at"  # run_steps' result: the step where early stopping ended the run


def run_steps(run: TrainingRun, stop: StopRequest) -> dict[str, float]:
    """Steps from run.step to train.num_steps: train, log, validate, checkpoint; returns the last logged metrics (and
    STOPPED_EARLY_AT). A stop request or NonFiniteError (re-raised) saves the state reached, the last good one."""
    config, num_steps = run.config, run.config.train.num_steps
    # A restored run has its checkpoint at run.step; a new one has none yet.
    state, step, saved_step, it_state, last_logged = run.state, run.step, run.step or None, None, {}
    stopping = False
    ranked = bookkeeping.is_tracked(config)
    if ranked and run.record.still_stopped(config):
        logging.warning(
            "this run stopped early at step %d after %d validations without improvement; %s. Nothing to train: "
            "raise train.num_steps or train.early_stop_patience to continue",
            run.record.stopped_at,
            run.record.since_best,
            run.record.describe(),
        )
        return {STOPPED_EARLY_AT: run.record.stopped_at}
    try:
        while step < num_steps:
            stopping = stop.due(step)
            if stopping:
                break
            batch, real_tokens, shape = next(run.batches)
            it_state = run.batches.get_state()
            state, metrics = run.train_step(state, batch)
            step += 1
            if step == run.step + 1:  # what a restart waits for before training moves: mostly compilation
                jax.block_until_ready(metrics)
                logging.info("step %d is this process's first", step)
            run.metric_log.add(metrics, real_tokens, train_step_flops(run.spec, *shape), step)
            if is_due(step, config.train.log_every, num_steps):
                last_logged = run.metric_log.write(step)
            if ranked and is_due(step, config.train.eval_every, num_steps):
                # Ranked: the scores decide whether this step is saved, so validation runs before the checkpoint.
                if _validate_and_rank(run, step, state, it_state):
                    saved_step = step
                if run.record.stopped_at is not None:
                    break
                continue
            # Checkpoint first: validation BLEU decodes for minutes, and a crash in it must not cost the steps.
            if is_due(step, config.ckpt.every_steps, num_steps) and save_if_finite(run, step, state, it_state):
                saved_step = step
            run.validation.run_due(step, state)
        run.metric_log.flush()
        if stopping:
            if it_state is None and saved_step != step:  # stopped before this new run's first batch
                logging.warning("SIGTERM before the first step: nothing trained, nothing saved; exiting")
            elif saved_step == step or save_if_finite(run, step, state, it_state):
                logging.warning("SIGTERM: saved the checkpoint at step %d; exiting", step)
            else:
                logging.warning("SIGTERM: exiting at step %d without saving it (see the error above)", step)
    except NonFiniteError:
        # Finite but maybe diverging: saved without rotating away the checkpoints before it.
        if saved_step != step:
            save_if_finite(run, step, state, it_state, rotate=False)
        raise
    if ranked and run.record.stopped_at is not None:
        return {**last_logged, STOPPED_EARLY_AT: run.record.stopped_at}
    return last_logged


def _validate_and_rank(run: TrainingRun, step: int, state, it_state) -> bool:
    """Validates after `step`, updates the selection record, and saves a checkpoint with the scores if the step is
    due one or improved the select metric; marks the record stopped once the patience is spent. Whether it saved."""
    config, record = run.config, run.record
    scores = run.validation.run_due(step, state)
    metric = config.train.select_metric
    improved = record.update(step, scores.get(metric, bookkeeping.worst(metric)))
    if improved:
        logging.info("step %d improved %s to %.4f", step, metric, record.best_score)
    if record.exhausted(config.train.early_stop_patience):
        record.stop(step, config)
        logging.warning(
            "early stopping at step %d: %d validations without improvement of %s; %s",
            step,
            record.since_best,
            metric,
            record.describe(),
        )
    due = is_due(step, config.ckpt.every_steps, config.train.num_steps) or improved or record.stopped_at is not None
    return due and save_if_finite(run, step, state, it_state, metrics=scores)


def train_and_evaluate(
    config: ml_collections.ConfigDict,
    workdir: str | pathlib.Path,
    bleu: BleuEvaluator | None = None,
    overrides: tuple[str, ...] = (),
) -> dict[str, float]:
    """Trains (or resumes) in workdir, locked for the run, until train.num_steps; returns the last logged metrics.
    `overrides`, the keys set on the command line, may not contradict a train.init_from source's architecture."""
    if bleu is None and (config.train.bleu_every or decodes_at_validation(config)):
        raise ValueError(
            f"train.bleu_every={config.train.bleu_every} or train.select_metric={config.train.select_metric} needs "
            "a BLEU evaluator: pass bleu=transformer_jax.evaluation.translate.bleu_evaluator"
        )
    workdir = pathlib.Path(workdir)
    config = languages.expand_config(config)  # data.directions explicit before any config is compared or saved
    with bookkeeping.locked(workdir):
        # A fine-tuning run starts from its source's architecture and parameters; any other from its config.
        start = init_from.prepare(config, workdir, overrides) if config.train.init_from else init_from.Start(config)
        run = setup(start.config, workdir, bleu, start.params, start.source_step)
        try:
            with StopRequest() as stop, tracing_mesh(run.mesh):
                return run.writer.finish(run_steps(run, stop))  # the trackers' final scores
        finally:
            run.close()
