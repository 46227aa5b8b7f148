"""Decoding: search over a decode step, its binding to the Transformer, and the host-side scheduler.

Read from a translation: scheduler.py (`Searcher`, a search spec run over a model's parameters: one batch, or a list
of sentences through the refilling scheduler, where finished sentences leave the running batch and waiting ones take
their rows); model_calls.py (the Transformer as a decode step, and the jitted calls the Searcher makes); specs.py (one
small frozen spec per search, `search_for` mapping evaluate.py's settings to one, and sampling's token choice);
state.py (the loop states a spec starts and advances); ensemble.py (several models behind one model's interface).

`__all__` is what the rest of the package, the command lines and the benchmarks use, and the spec classes that
docs/decoding.md shows Python users; the tests reach the rest through the modules.
"""

from transformer_jax.decoding.ensemble import Ensemble
from transformer_jax.decoding.model_calls import cached_decode_step, recompute_decode_step
from transformer_jax.decoding.scheduler import Searcher, batch_rows, source_batch
from transformer_jax.decoding.specs import (
    FINISHED_RULES,
    IN_BEAM,
    PLAIN_SAMPLING,
    Beam,
    BeamResult,
    Greedy,
    Sampled,
    Sampling,
    Search,
    SetAside,
    beam_search,
    sample_keys,
    search_for,
    search_spec,
)
from transformer_jax.decoding.state import GNMT, LENGTH_PENALTIES, cache_stages, tile_beams

__all__ = [
    # the search specs
    "Search",
    "Greedy",
    "Beam",
    "SetAside",
    "Sampled",
    "Sampling",
    "search_spec",
    "search_for",
    "FINISHED_RULES",
    "IN_BEAM",
    "GNMT",
    "LENGTH_PENALTIES",
    "PLAIN_SAMPLING",
    "sample_keys",
    # running them
    "Searcher",
    "BeamResult",
    "batch_rows",
    "source_batch",
    "cache_stages",
    "Ensemble",
    # a search over a decode step (benchmarks/decode.py)
    "beam_search",
    "cached_decode_step",
    "recompute_decode_step",
    "tile_beams",
]
