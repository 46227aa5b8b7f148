"""The decoding modes' options beyond one search (n-best lists, sampling, MBR, target prefixes, forced decoding,
ensembles): their checks, which run before any file is read or the model restored (evaluation.options.parse calls
`check_flags`), and the ensemble's members.

`o` holds evaluate.py's flag values by name (None: not given), which the messages name; the allowed values of a
flag with choices are checked by `parse`, from the flag table (evaluation.options.FLAGS).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from transformer_jax.decoding import PLAIN_SAMPLING
from transformer_jax.errors import EvalError
from transformer_jax.evaluation.restore import restore_model
from transformer_jax.evaluation.translate import check_nbest

# The flags of a search, which --score (forced decoding: no search) would ignore.
SEARCH_FLAGS = ("beam_size", "alpha", "max_extra_len", "max_len", "length_penalty", "finished", "nbest")


def check_flags(o: Any) -> None:
    """EvalError for decoding flags that cannot work together: sampling with searching, --nbest over the beam size
    (when --beam_size is given; the config's is checked once read), --nbest, --mbr or --sampling with stdin."""
    _check_mbr(o)
    if o.sampling:
        if o.beam_size not in (None, 1):
            raise EvalError(f"--sampling draws one token per step; --beam_size {o.beam_size} would be ignored")
        if o.nbest is not None or o.score:
            raise EvalError("--sampling draws --num_samples translations per line; drop --nbest and --score")
        if o.finished is not None:
            raise EvalError("--finished is beam search's rule; --sampling does not search: drop one of them")
        if o.source_file == "-":
            raise EvalError("--sampling needs a --source_file or a --split: stdin is translated one line at a time")
    if o.prefix_file is not None and (o.score or o.source_file == "-"):
        raise EvalError("--prefix_file goes with translating a --source_file or a --split (not --score, not stdin)")
    if o.ensemble_workdirs is not None:
        if not o.ensemble_workdirs or not all(o.ensemble_workdirs):
            raise EvalError(
                f"--ensemble_workdirs must be workdirs separated by commas, got {list(o.ensemble_workdirs)}"
            )
    if o.score:
        searching = [f"--{k}" for k in SEARCH_FLAGS if getattr(o, k) is not None]
        if searching:
            raise EvalError(
                f"--score teacher-forces the given targets; {', '.join(searching)} would be ignored: drop "
                f"{'it' if len(searching) == 1 else 'them'}"
            )
        if o.source_file == "-":
            raise EvalError("--score reads its pairs from --source_file and --references_file, not stdin")
        if o.source_file is not None and not o.references_file:
            raise EvalError("--score needs --references_file (the targets to score) with --source_file, or a --split")
    if o.nbest is not None:
        if o.source_file == "-":
            raise EvalError("--nbest needs a --source_file or a --split: stdin is translated one line at a time")
        # Without --beam_size only nbest >= 1 can be checked here; run.settings_of checks the config's beam size.
        check_nbest(o.nbest, o.nbest if o.beam_size is None else o.beam_size)


def _check_mbr(o: Any) -> None:
    if o.mbr is None:
        return
    if o.mbr < 2:
        raise EvalError(f"--mbr {o.mbr}: choose among at least 2 candidates")
    for name in ("nbest", "num_samples"):
        if getattr(o, name) is not None:
            raise EvalError(f"--mbr N sets how many candidates there are; --{name} would be ignored: drop it")
    if o.score or o.source_file == "-":
        raise EvalError("--mbr translates a --source_file or a --split (not --score, not stdin)")


def sampling_of(o: Any):
    """The decoding.Sampling the flags ask for (unset ones: decoding.PLAIN_SAMPLING's), or None without --sampling."""
    if not o.sampling:
        return None
    given = {k: getattr(o, k) for k in ("temperature", "top_k", "top_p") if getattr(o, k) is not None}
    return dataclasses.replace(PLAIN_SAMPLING, **given)


def check_prefix_count(prefixes: Sequence[str], sources: Sequence[str], prefix_name: str, source_name: str) -> None:
    """EvalError unless there is one prefix line per source line."""
    if len(prefixes) != len(sources):
        raise EvalError(
            f"line counts differ: --prefix_file {prefix_name} has {len(prefixes)} lines, {source_name} has "
            f"{len(sources)}; give one prefix line per source line (an empty line for none)"
        )


# -- ensembles ----------------------------------------------------------------------------------------------------


def check_ensemble_members(restorer: Any, workdirs: Sequence[str]) -> None:
    """EvalError naming the first member without checkpoints (cheap: before any model is restored)."""
    for workdir in workdirs:
        if not restorer.list_steps(workdir):
            raise EvalError(f"--ensemble_workdirs member {workdir} has no checkpoint; train it first or drop it")


def tokenizer_fingerprint(config: Any, tokenizer: Any) -> tuple[str, str]:
    """(what differs, in words) pairs an ensemble's members must share: the vocabulary size and the tokenizer's
    fingerprint (a tokenizer without one: its class)."""
    fingerprint = getattr(tokenizer, "fingerprint", None)
    digest = fingerprint()[:16] if fingerprint else type(tokenizer).__name__
    return (f"vocabulary size {config.model.vocab_size}", f"tokenizer {digest}")


def restore_members(restorer: Any, workdirs: Sequence[str], config: Any, tokenizer: Any) -> list[Any]:
    """The members' models (each its latest checkpoints, averaged as its own config says). Every member's saved
    config and tokenizer are checked first: the first difference from the main model's vocabulary or tokenizer is
    refused before any member's parameters are read."""
    expected = tokenizer_fingerprint(config, tokenizer)
    for workdir in workdirs:
        member_config = restorer.load_config(workdir).copy_and_resolve_references()
        with member_config.unlocked():
            member_config.data.target_lang = config.data.target_lang  # the members read the same sources
        got = tokenizer_fingerprint(member_config, restorer.tokenizer(member_config, workdir))
        for want, have in zip(expected, got, strict=True):
            if want != have:
                raise EvalError(
                    f"--ensemble_workdirs member {workdir} has {have}, --workdir has {want}: ensemble members must "
                    "share one tokenizer"
                )
    return [restore_model(restorer, workdir)[1] for workdir in workdirs]
