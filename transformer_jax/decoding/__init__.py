"""Decoding: search over a decode step (search.py: greedy and beam; set_aside.py: beam search that sets finished
hypotheses aside; sampling.py: drawing tokens), one frozen spec per search (searches.py), the Transformer's decode
step (binding.py), the jitted calls (calls.py), the host-side scheduler that refills a running batch as sentences
finish (refill.py), and `Searcher`, which runs a spec over a model (searcher.py).

Callers use this package's names: a spec (`Greedy`, `Beam`, `SetAside`, `Sampled`, or `search_for` from evaluate.py's
settings), `searcher(model)` / `Searcher` to run it, `search` for one batch, and the search functions over any decode
step (`greedy_search`, `beam_search`, set_aside.py's `set_aside_search`).
"""

from transformer_jax.decoding.binding import cached_decode_step, recompute_decode_step
from transformer_jax.decoding.refill import (
    ENCODE_MULTIPLE,
    FULL_CACHE_SENTENCES,
    MIN_ROWS,
    compacted_size,
    refill_size,
    source_batch,
)
from transformer_jax.decoding.sampling import Sampling, sample_keys
from transformer_jax.decoding.searcher import Searcher, search, searcher
from transformer_jax.decoding.searches import (
    FINISHED_RULES,
    IN_BEAM,
    SET_ASIDE,
    Beam,
    Greedy,
    Sampled,
    Search,
    SetAside,
    run_search,
    search_for,
    search_spec,
)
from transformer_jax.decoding.state import (
    AVERAGE,
    FIRST_STAGE,
    GNMT,
    LENGTH_PENALTIES,
    NEG_INF,
    NONE,
    BeamResult,
    BeamState,
    Decoder,
    DecodeStep,
    GreedyResult,
    GreedyState,
    SetAsideState,
    beam_search,
    best_first,
    cache_stages,
    first_argmax,
    gather_rows,
    greedy_search,
    length_penalty,
    set_aside_search,
    tile_beams,
)

__all__ = [
    "AVERAGE",
    "FINISHED_RULES",
    "GNMT",
    "IN_BEAM",
    "SET_ASIDE",
    "SetAsideState",
    "set_aside_search",
    "LENGTH_PENALTIES",
    "NONE",
    "ENCODE_MULTIPLE",
    "FIRST_STAGE",
    "FULL_CACHE_SENTENCES",
    "MIN_ROWS",
    "NEG_INF",
    "Beam",
    "BeamResult",
    "BeamState",
    "DecodeStep",
    "Decoder",
    "Greedy",
    "GreedyResult",
    "GreedyState",
    "Sampled",
    "Sampling",
    "Search",
    "SetAside",
    "Searcher",
    "beam_search",
    "best_first",
    "cache_stages",
    "cached_decode_step",
    "compacted_size",
    "first_argmax",
    "gather_rows",
    "greedy_search",
    "length_penalty",
    "recompute_decode_step",
    "refill_size",
    "sample_keys",
    "run_search",
    "search",
    "search_for",
    "search_spec",
    "searcher",
    "source_batch",
    "tile_beams",
]
