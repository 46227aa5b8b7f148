"""Decoding speed: a trained model against CTranslate2, or the KV cache against full recompute; prints JSON.

    python -m benchmarks.decode --workdir runs/m30k [--split test --batch_size 64 --threads 2 --beam_sizes 4,1]
    python -m benchmarks.decode --config configs/wmt14_ende.py:size=base --beam_size 4 --num_sentences 16
    python -m benchmarks.decode --workdir runs/m30k --corpus data/multi30k/train.en [--corpus_lines 500]
    python -m benchmarks.decode --workdir runs/nllb --source_file in.txt [--references_file ref.txt] \
        --source_lang en --target_lang de --beam_sizes 1

With --workdir (side by side), --modes translate (the default): the workdir's model (the checkpoints evaluate.py
would average) translates the split with evaluation.translate.translate (evaluate.py's path) and, exported with the
same weights (transformer_jax.interop.ctranslate2), with CTranslate2 on --threads threads; one JSON line per beam
size with each engine's first-call time (ours includes XLA compilation), its steady-state time (the best of
--repeats further calls), sacreBLEU, and how many outputs are identical. Both sides use the same tokenization,
source truncation and per-sentence output limits (evaluation/translate.py's rules); CTranslate2's length penalty is
its own formula, so only greedy outputs are expected to be identical, unless ours is `--length_penalty average`
(CTranslate2's formula) with `--finished set_aside` (its search: decoding/state.py SetAsideState), one line per
--finished rule for each beam size above 1. XLA uses every core of the machine: run with --threads equal to that count.
--source_file (and --references_file for BLEU) translates a file instead of the split; a multilingual model, such as
a converted M2M-100 or NLLB-200 one, takes --source_lang and --target_lang as evaluate.py does, and both engines
get the direction's language tokens (a converted model's beam search ranks otherwise on CTranslate2, which scores
the forced target code: compare it greedy).

--fresh_process: whole processes instead of calls, start to exit: evaluate.py with the compilation cache cold and
warm against a CTranslate2 process that loads the export and translates (benchmarks/fresh_process.py).

--corpus FILE [--corpus_lines N]: whole processes on a corpus: `python -m transformer_jax.translate_corpus` (compile
included; cold, then warm compilation cache) on the first N lines of FILE (0: all) against CTranslate2's process
with the same weights on the same lines, one JSON line per beam size (benchmarks/fresh_process.py).

--modes nbest,score,sampling: the decoding modes, one JSON line each, against their counterparts: the --nbest
best (default 4) of beam 4 against CTranslate2's num_hypotheses (its length_penalty is our `average` penalty), for
each of --finished's rules (in_beam, set_aside: CTranslate2's own search, decoding/state.py SetAsideState),
forced decoding of the split's references against score_batch, and sampling against our own greedy search
(`modes_side_by_side`; with the output tokens (EOS included) of both and the ratio of the times per output token).

Without --workdir (random weights):

Random weights; sources are the first lines of newstest2014 (../shared/data/wmt14_ende/test.en), tokenized by a
SentencePiece model trained on those 500 lines in a few seconds (--tokenizer spm) or as UTF-8 bytes (--tokenizer
bytes). EOS is masked so every sentence decodes exactly --output_len tokens.

Both modes run the same jitted beam search over a fixed buffer of --output_len target slots:
  cache:     decode one token per step against the cached keys/values (transformer_jax.decoding.cached_decode_step);
  recompute: decode the whole target buffer again every step, no cache (decoding.recompute_decode_step).
Time per step = (t(n steps) - t(1 step)) / (n - 1), which removes the encoder and the one-off costs; recompute is
timed over --recompute_steps steps (each of its steps costs the same, the buffer being fixed) and its whole-search
time extrapolated. FLOPs per step come from XLA's cost analysis of one compiled step.
"""

from __future__ import annotations

import functools
import json
import os
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx
from ml_collections import config_flags

from benchmarks import fresh_process
from transformer_jax import cli, decoding
from transformer_jax.data.sources import local_data_dir
from transformer_jax.data.tokenizer import train_tokenizer
from transformer_jax.errors import DataError
from transformer_jax.evaluation.restore import CheckpointChoice
from transformer_jax.evaluation.run import Model, Translate, load, split_name
from transformer_jax.evaluation.translate import DecodeSettings, position_limit, sacrebleu_scores, translate
from transformer_jax.interop.ctranslate2 import ctranslate2_translate, to_ctranslate2
from transformer_jax.model import build_model, model_rngs, unpacked_segment_ids
from transformer_jax.model.layers import SpecialIds

DATA = (local_data_dir() or Path("$TRANSFORMER_JAX_DATA")) / "wmt14_ende" / "test.en"
NUM_LINES = 500

_CONFIG = config_flags.DEFINE_config_file("config", "configs/wmt14_ende.py:size=base", "Config file[:arg].")
_BEAM_SIZE = flags.DEFINE_integer("beam_size", 4, "Beams per sentence.")
_NUM_SENTENCES = flags.DEFINE_integer("num_sentences", 16, "Sentences decoded together (one batch).")
_OUTPUT_LEN = flags.DEFINE_integer("output_len", 50, "Target tokens decoded per sentence.")
_RECOMPUTE_STEPS = flags.DEFINE_integer("recompute_steps", 4, "Steps timed for recompute (>= 2); 0 skips.")
_TOKENIZER = flags.DEFINE_enum("tokenizer", "spm", ["spm", "bytes"], "How the sources become ids.")
_REPEATS = flags.DEFINE_integer("repeats", 2, "Timed repeats of each search; the fastest counts.")
_WORKDIR = flags.DEFINE_string("workdir", None, "A trained workdir: benchmark it side by side with CTranslate2.")
_SPLIT = flags.DEFINE_enum("split", "test", ["valid", "test"], "Split of the workdir's config to translate.")
_BATCH_SIZE = flags.DEFINE_integer("batch_size", 64, "Sentences per batch, on both sides.")
_THREADS = flags.DEFINE_integer("threads", 2, "CTranslate2's intra_threads (XLA uses every core).")
_BEAM_SIZES = flags.DEFINE_list("beam_sizes", ["4", "1"], "Beam sizes to compare (1 is greedy).")
_ALPHA = flags.DEFINE_float("alpha", 0.6, "Length penalty alpha (each engine's own formula).")
_FINISHED = flags.DEFINE_list(
    "finished",
    [decoding.IN_BEAM],
    "translate (beam > 1) and nbest modes: beam search's rules for ended hypotheses (in_beam, set_aside), a line each.",
)
_LENGTH_PENALTY = flags.DEFINE_string(
    "length_penalty", decoding.GNMT, "translate mode: our length penalty (average is CTranslate2's formula)."
)
_MODES = flags.DEFINE_list(
    "modes", ["translate"], "With --workdir: translate (1-best), nbest (4-best), score (forced decoding), sampling."
)
_FRESH = flags.DEFINE_bool(
    "fresh_process", False, "With --workdir: whole evaluate.py processes, cold and warm cache, vs CTranslate2's."
)
_CORPUS = flags.DEFINE_string(
    "corpus", None, "With --workdir: time translate_corpus's whole process on this file against CTranslate2's."
)
_CORPUS_LINES = flags.DEFINE_integer("corpus_lines", 0, "With --corpus: its first N lines (0: all).")
_AVERAGE_LAST = flags.DEFINE_integer("average_last", None, "Checkpoints to average (default: the config's).")
_SOURCE_FILE = flags.DEFINE_string("source_file", None, "translate mode: translate this file instead of --split.")
_REFERENCES_FILE = flags.DEFINE_string("references_file", None, "With --source_file: its references (for BLEU).")
_SOURCE_LANG = flags.DEFINE_string("source_lang", None, "translate mode: a multilingual model's source language.")
_TARGET_LANG = flags.DEFINE_string("target_lang", None, "translate mode: the language to translate into.")


def timed_calls(fn, repeats: int) -> tuple[float, float, object]:
    """(first-call seconds, best of `repeats` further calls, the last result)."""
    start = time.perf_counter()
    result = fn()
    first = time.perf_counter() - start
    steady = []
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        steady.append(time.perf_counter() - start)
    return first, min(steady), result


def bleu(hypotheses: list[str], references: list[str] | None) -> float | None:
    """sacreBLEU, rounded; None without references (a --source_file alone)."""
    return None if references is None else round(sacrebleu_scores(hypotheses, references)["bleu"]["score"], 2)


def side_by_side(workdir: str) -> None:
    """One JSON line per beam size: our translate() against CTranslate2 with the same weights (module docstring)."""
    import ctranslate2  # optional (pip install -e .[ctranslate2]): only this comparison needs it

    model_flags = Model(
        workdir,
        choice=CheckpointChoice(average_last=_AVERAGE_LAST.value),
        source_lang=_SOURCE_LANG.value,
        target_lang=_TARGET_LANG.value,
    )
    split = None if _SOURCE_FILE.value else _SPLIT.value
    loaded = load(Translate(model_flags, split, _SOURCE_FILE.value, references_file=_REFERENCES_FILE.value))
    config, model, steps, tokenizer = loaded.config, loaded.model, loaded.steps, loaded.tokenizer
    sources, references, language_ids = loaded.sources, loaded.references, loaded.language_ids
    split = loaded.name if _SOURCE_FILE.value else split_name(config, _SPLIT.value)
    with tempfile.TemporaryDirectory() as tmp:
        export_dir = to_ctranslate2(model, tokenizer, Path(tmp) / "ct2")
        translator = ctranslate2.Translator(
            str(export_dir), device="cpu", inter_threads=1, intra_threads=_THREADS.value
        )
        runs = [(b, f) for b in map(int, _BEAM_SIZES.value) for f in (_FINISHED.value if b > 1 else [decoding.IN_BEAM])]
        for beam_size, finished in runs:
            settings = DecodeSettings(
                decoding.search_for(beam_size, _ALPHA.value, _LENGTH_PENALTY.value, finished),
                max_extra_len=config.eval.max_extra_len,
                max_len=config.eval.max_len,
                batch_size=_BATCH_SIZE.value,
                max_input_len=config.data.eval_max_len,
            )
            ours = timed_calls(
                functools.partial(translate, model, tokenizer, sources, settings, language_ids=language_ids),
                _REPEATS.value,
            )
            theirs = timed_calls(
                functools.partial(
                    ctranslate2_translate,
                    translator,
                    tokenizer,
                    sources,
                    settings,
                    position_limit=position_limit(model.spec),
                    language_ids=language_ids,
                ),
                _REPEATS.value,
            )
            report = {"workdir": workdir, "steps": steps, "split": split, "sentences": len(sources)}
            report.update(**settings.report(), length_penalty=_LENGTH_PENALTY.value, finished=finished)
            report.update(backend=jax.default_backend(), cores=os.cpu_count(), ctranslate2_threads=_THREADS.value)
            for name, (first, steady, (hyps, _)) in (("ours", ours), ("ctranslate2", theirs)):
                report[name] = {
                    "first_call_s": round(first, 2),
                    "steady_s": round(steady, 2),
                    "sentences_per_s": round(len(sources) / steady, 1),
                    "bleu": bleu(hyps, references),
                }
            report["time_ratio_ours_over_ctranslate2"] = round(ours[1] / theirs[1], 2)
            report["identical_outputs"] = sum(a == b for a, b in zip(ours[2][0], theirs[2][0], strict=True))
            print(json.dumps(report), flush=True)


NBEST_BEAM = 4  # beam size of the nbest mode
_NBEST = flags.DEFINE_integer("nbest", NBEST_BEAM, "Hypotheses per sentence in the nbest mode (at most its beam, 4).")


def modes_side_by_side(workdir: str, modes: list[str]) -> None:
    """One JSON line per mode, each against its counterpart (module docstring): nbest against CTranslate2's
    num_hypotheses (--nbest of beam NBEST_BEAM, its length_penalty = our `average` penalty), score against
    score_batch, sampling (temperature 1, no cut, seed 0) against our own greedy search."""
    import ctranslate2

    from transformer_jax.evaluation.restore import CheckpointChoice, restore_model, workdir_tokenizer
    from transformer_jax.evaluation.run import split_pairs
    from transformer_jax.evaluation.scoring import score_pairs
    from transformer_jax.evaluation.translate import (
        input_limit,
        output_cap,
        output_limit,
        position_limit,
        source_ids,
        translate_nbest,
    )
    from transformer_jax.interop.ctranslate2 import to_ctranslate2, vocabulary

    config, model, steps = restore_model(workdir, CheckpointChoice(average_last=_AVERAGE_LAST.value))
    tokenizer = workdir_tokenizer(config, workdir)
    sources, references, split = split_pairs(config, _SPLIT.value)
    pieces = vocabulary(tokenizer)
    limit = position_limit(model.spec)
    max_input_len = input_limit(config.data.eval_max_len, limit)
    ids = [source_ids(tokenizer, s, max_input_len)[0] for s in sources if s.strip()]
    longest = max(output_limit(len(x), config.eval.max_extra_len, output_cap(config.eval.max_len, limit)) for x in ids)
    common = dict(
        max_extra_len=config.eval.max_extra_len,
        max_len=config.eval.max_len,
        batch_size=_BATCH_SIZE.value,
        max_input_len=config.data.eval_max_len,
    )
    with tempfile.TemporaryDirectory() as tmp:
        translator = ctranslate2.Translator(
            str(to_ctranslate2(model, tokenizer, Path(tmp) / "ct2")),
            device="cpu",
            inter_threads=1,
            intra_threads=_THREADS.value,
        )
        batch = [[pieces[t] for t in x[:-1]] for x in ids]
        index = {piece: i for i, piece in enumerate(pieces)}
        runs = [(m, f) for m in modes for f in (_FINISHED.value if m == "nbest" else [None])]
        for mode, finished in runs:
            if mode == "nbest":
                search = decoding.search_for(NBEST_BEAM, _ALPHA.value, "average", finished)
                ours = functools.partial(
                    translate_nbest, model, tokenizer, sources, DecodeSettings(search, **common), nbest=_NBEST.value
                )
                theirs = functools.partial(
                    translator.translate_batch,
                    batch,
                    max_batch_size=_BATCH_SIZE.value,
                    beam_size=NBEST_BEAM,
                    num_hypotheses=_NBEST.value,
                    length_penalty=_ALPHA.value,
                    max_input_length=0,
                    max_decoding_length=longest,
                    min_decoding_length=0,
                )
                baseline = "ctranslate2 num_hypotheses"
            elif mode == "score":
                ours = functools.partial(
                    score_pairs,
                    model,
                    tokenizer,
                    sources,
                    references,
                    batch_size=_BATCH_SIZE.value,
                    max_len=config.data.eval_max_len,
                )
                theirs = functools.partial(
                    translator.score_batch,
                    [[pieces[t] for t in tokenizer.encode_source(x)] for x in sources],
                    [[pieces[t] for t in tokenizer.encode_target(x)] for x in references],
                    max_batch_size=_BATCH_SIZE.value,
                )
                baseline = "ctranslate2 score_batch"
            elif mode == "sampling":
                sampled = decoding.search_for(1, _ALPHA.value, sampling=decoding.Sampling(1.0, 0, 1.0))
                greedy = decoding.search_for(1, _ALPHA.value)
                ours = functools.partial(
                    translate_nbest, model, tokenizer, sources, DecodeSettings(sampled, **common), nbest=1
                )
                theirs = functools.partial(
                    translate_nbest, model, tokenizer, sources, DecodeSettings(greedy, **common), nbest=1
                )
                baseline = "our greedy search"
            else:
                raise DataError(f"--modes: unknown mode {mode!r}; choose among translate, nbest, score, sampling")
            first, steady, ours_result = timed_calls(ours, _REPEATS.value)
            base_first, base_steady, base_result = timed_calls(theirs, _REPEATS.value)
            report = {"workdir": workdir, "steps": steps, "split": split, "sentences": len(sources), "mode": mode}
            if mode == "nbest":
                report.update(nbest=_NBEST.value, beam_size=NBEST_BEAM, finished=finished)
                # Lists equal to CTranslate2's, hypothesis for hypothesis (its one call has one output limit, the
                # longest sentence's, so a list that reaches a shorter sentence's limit can differ).
                theirs_lists = [
                    [tokenizer.decode_target([index[p] for p in h]) for h in r.hypotheses] for r in base_result
                ]
                ours_lists = [[h.text for h in x] for x, s in zip(ours_result[0], sources, strict=True) if s.strip()]
                report["identical_lists"] = sum(a == b for a, b in zip(ours_lists, theirs_lists, strict=True))
            report.update(backend=jax.default_backend(), cores=os.cpu_count(), ctranslate2_threads=_THREADS.value)
            report["ours"] = {"first_call_s": round(first, 2), "steady_s": round(steady, 2)}
            report["baseline"] = {
                "what": baseline,
                "first_call_s": round(base_first, 2),
                "steady_s": round(base_steady, 2),
            }
            report["time_ratio_ours_over_baseline"] = round(steady / base_steady, 2)
            if mode == "sampling":  # sampled outputs differ in length from greedy ones: the ratio per output token
                tokens, base_tokens = ours_result[1]["tgt_tokens"], base_result[1]["tgt_tokens"]
                report["ours"]["output_tokens"], report["baseline"]["output_tokens"] = tokens, base_tokens
                report["time_per_token_ratio"] = round(steady / tokens / (base_steady / base_tokens), 2)
            print(json.dumps(report), flush=True)


def source_ids(kind: str, vocab_size: int, num_sentences: int, max_len: int) -> tuple[list[list[int]], str]:
    if not DATA.exists():
        raise DataError(f"{DATA} not found (the shared data folder is absent on this machine)")
    lines = DATA.read_text(encoding="utf-8").splitlines()[:NUM_LINES]
    if kind == "bytes":
        ids = [[4 + b for b in line.encode("utf-8")] for line in lines]
        how = "UTF-8 bytes -> ids 4..259"
    else:
        size = min(2000, vocab_size)
        with tempfile.TemporaryDirectory() as tmp:
            tok = train_tokenizer(
                lines, Path(tmp) / "spm.model", vocab_size=size, model_type="unigram", ids=SpecialIds.DEFAULT
            )
            ids = [tok.encode_source(line) for line in lines]
        how = f"SentencePiece unigram, {size} pieces, trained on the {len(lines)} lines"
    ids = [x[: max_len - 1] + [SpecialIds.DEFAULT.eos] for x in ids[:num_sentences]]  # the models' default ids
    return ids, how


@functools.partial(jax.jit, static_argnames=("graphdef", "beam_size", "max_steps", "use_cache"))
def run_search(graphdef, state, src_BS, max_len_B, *, beam_size, max_steps, use_cache):
    """Beam search with EOS masked, so each sentence decodes exactly max_len_B tokens."""
    model = nnx.merge(graphdef, state)
    ids = SpecialIds.of(model.spec)
    seg = unpacked_segment_ids(src_BS, ids.pad)
    make = decoding.cached_decode_step if use_cache else decoding.recompute_decode_step
    d = make(model, model.encode(src_BS, seg), seg, beam_size=beam_size, max_steps=max_steps)

    def no_eos_step(tokens, cache):
        logits, cache = d.step(tokens, cache)
        return logits.at[..., ids.eos].set(-jnp.inf), cache

    return decoding.beam_search(
        no_eos_step, d.cache, max_len_B, beam_size=beam_size, alpha=0.6, max_steps=max_steps, grow=d.grow, ids=ids
    )


def step_flops(model, src_BS, *, beam_size: int, max_steps: int, use_cache: bool) -> float:
    """FLOPs of one decode step for B * beam_size rows, from XLA's cost analysis (encoder and cache setup excluded)."""
    graphdef, state = nnx.split(model)
    seg = unpacked_segment_ids(src_BS, model.spec.pad_id)
    memory = model.encode(src_BS, seg)
    make = decoding.cached_decode_step if use_cache else decoding.recompute_decode_step

    def one_step(state, memory, seg, cache, tokens):
        m = nnx.merge(graphdef, state)
        step = make(m, memory, seg, beam_size=beam_size, max_steps=max_steps).step
        return step(tokens, cache)

    def dynamic_cache(state, memory, seg):
        m = nnx.merge(graphdef, state)
        d = make(m, memory, seg, beam_size=beam_size, max_steps=max_steps)
        # The last stage's cache (max_steps slots): the cost of a step as the longest outputs reach their limit.
        return decoding.tile_beams(d.cache if d.grow is None else d.grow(d.cache, max_steps), beam_size)

    def setup(state, memory, seg):
        """Everything a search does once per batch before its first step (returned, so none of it is pruned)."""
        m = nnx.merge(graphdef, state)
        if use_cache:
            return decoding.tile_beams(m.init_cache(memory, seg, max_steps), beam_size)
        return decoding.tile_beams((memory, seg), beam_size)

    cache = jax.eval_shape(dynamic_cache, state, memory, seg)
    tokens = jax.ShapeDtypeStruct((src_BS.shape[0] * beam_size, 1), jnp.int32)
    # The cached step's closure projects the cross-attention keys/values from memory (done once per sentence in a
    # search, not per step); subtract that setup by costing it alone.
    full = jax.jit(one_step).lower(state, memory, seg, cache, tokens).compile().cost_analysis()
    only_setup = jax.jit(setup).lower(state, memory, seg).compile().cost_analysis()
    cost = lambda c: float((c[0] if isinstance(c, list) else c).get("flops", 0.0))
    return cost(full) - cost(only_setup)


def best_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return min(times)


def main(argv: list[str]) -> None:
    del argv  # no positional arguments (transformer_jax.cli.run refuses them)
    if _CORPUS.value and not _WORKDIR.value:
        raise DataError("--corpus translates with a trained model: give --workdir")
    if _WORKDIR.value and _CORPUS.value:
        fresh_process.corpus_vs_ctranslate2(
            _WORKDIR.value,
            _CORPUS.value,
            lines=_CORPUS_LINES.value,
            beam_sizes=[int(b) for b in _BEAM_SIZES.value],
            batch_size=_BATCH_SIZE.value,
            threads=_THREADS.value,
            alpha=_ALPHA.value,
            average_last=_AVERAGE_LAST.value,
            repeats=_REPEATS.value,
        )
        return
    if _WORKDIR.value and _FRESH.value:
        fresh_process.evaluate_vs_ctranslate2(
            _WORKDIR.value,
            split=_SPLIT.value,
            beam_sizes=[int(b) for b in _BEAM_SIZES.value],
            batch_size=_BATCH_SIZE.value,
            threads=_THREADS.value,
            alpha=_ALPHA.value,
            average_last=_AVERAGE_LAST.value,
            repeats=_REPEATS.value,
        )
        return
    if _WORKDIR.value:
        if "translate" in _MODES.value:
            side_by_side(_WORKDIR.value)
        extra = [m for m in _MODES.value if m != "translate"]
        if extra:
            modes_side_by_side(_WORKDIR.value, extra)
        return
    config = _CONFIG.value
    cli.validate(config)  # as evaluate.py: list-valued overrides become their tuples, every key checked
    model = build_model(config, rngs=model_rngs(0))
    model.eval()
    ids, how = source_ids(_TOKENIZER.value, config.model.vocab_size, _NUM_SENTENCES.value, config.data.eval_max_len)
    batch, src_len = len(ids), max(len(x) for x in ids)
    src = np.zeros((batch, src_len), np.int32)
    for i, x in enumerate(ids):
        src[i, : len(x)] = x
    src = jnp.asarray(src)
    graphdef, state = nnx.split(model)
    length = _OUTPUT_LEN.value

    def timed(use_cache: bool, steps: int) -> tuple[float, decoding.BeamResult]:
        fn = functools.partial(
            run_search,
            graphdef,
            state,
            src,
            jnp.full((batch,), steps, jnp.int32),
            beam_size=_BEAM_SIZE.value,
            max_steps=length,
            use_cache=use_cache,
        )
        result = jax.block_until_ready(fn())  # compiles on the first call of a mode
        return best_time(fn, _REPEATS.value), result

    report = {
        "config": config_flags.get_config_filename(flags.FLAGS["config"]),
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0]),
        "params": int(sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))),
        "sentences": batch,
        "beam_size": _BEAM_SIZE.value,
        "source_tokens_max": src_len,
        "source_tokens_mean": round(float(np.mean([len(x) for x in ids])), 1),
        "tokenizer": how,
        "output_len": length,
    }
    start = time.perf_counter()
    t_full, cached = timed(True, length)
    t_one, _ = timed(True, 1)
    cached_step = (t_full - t_one) / (length - 1)
    report["cache"] = {
        "seconds": round(t_full, 3),
        "sentences_per_s": round(batch / t_full, 2),
        "target_tokens_per_s": round(batch * length / t_full, 1),
        "ms_per_step": round(1e3 * cached_step, 2),
        "gflops_per_step": round(
            step_flops(model, src, beam_size=_BEAM_SIZE.value, max_steps=length, use_cache=True) / 1e9, 3
        ),
    }
    if _RECOMPUTE_STEPS.value >= 2:
        t_n, recomputed = timed(False, _RECOMPUTE_STEPS.value)
        t_one, _ = timed(False, 1)
        step = (t_n - t_one) / (_RECOMPUTE_STEPS.value - 1)
        projected = t_one + step * (length - 1)
        n = _RECOMPUTE_STEPS.value
        report["recompute"] = {
            "steps_timed": n,
            "ms_per_step": round(1e3 * step, 2),
            "projected_seconds": round(projected, 3),
            "sentences_per_s": round(batch / projected, 3),
            "target_tokens_per_s": round(batch * length / projected, 2),
            "gflops_per_step": round(
                step_flops(model, src, beam_size=_BEAM_SIZE.value, max_steps=length, use_cache=False) / 1e9, 3
            ),
            # The same n-step search with the cache must give the same tokens.
            "tokens_equal_cache": bool(
                np.array_equal(np.asarray(recomputed.tokens), np.asarray(timed(True, n)[1].tokens))
            ),
        }
        report["speedup_per_step"] = round(step / cached_step, 2)
        report["speedup_whole_search"] = round(projected / t_full, 2)
    report["benchmark_seconds"] = round(time.perf_counter() - start, 1)
    print(json.dumps(report))


if __name__ == "__main__":
    cli.run(main, "python -m benchmarks.decode")
