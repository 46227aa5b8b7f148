"""Decoding: search over a decode step (search.py: greedy and beam; set_aside.py: beam search that sets finished
hypotheses aside), its binding to the Transformer (transformer.py: the decode step over the model's cache, and
`Searcher`), and the host-side scheduler that refills a running batch as sentences finish (refill.py).

Callers use this package's names: `searcher(model)` / `Searcher` for translation, `search` for one batch, and the
search functions over any decode step (`greedy_search`, `beam_search`, and set_aside.py's `set_aside_search`, which
sets finished hypotheses aside as CTranslate2 does).
"""

from transformer_jax.decoding.refill import (
    ENCODE_MULTIPLE,
    FULL_CACHE_SENTENCES,
    MIN_ROWS,
    compacted_size,
    refill_size,
    source_batch,
)
from transformer_jax.decoding.sampling import Sampling, sample_keys
from transformer_jax.decoding.search import (
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
    beam_search,
    best_first,
    cache_stages,
    first_argmax,
    gather_rows,
    greedy_search,
    length_penalty,
    tile_beams,
)
from transformer_jax.decoding.set_aside import (
    FINISHED_RULES,
    IN_BEAM,
    SET_ASIDE,
    SetAsideState,
    set_aside_search,
)
from transformer_jax.decoding.transformer import (
    Searcher,
    cached_decode_step,
    recompute_decode_step,
    search,
    searcher,
)
from transformer_jax.tokens import BOS_ID, EOS_ID, PAD_ID

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
    "BOS_ID",
    "ENCODE_MULTIPLE",
    "EOS_ID",
    "FIRST_STAGE",
    "FULL_CACHE_SENTENCES",
    "MIN_ROWS",
    "NEG_INF",
    "PAD_ID",
    "BeamResult",
    "BeamState",
    "DecodeStep",
    "Decoder",
    "GreedyResult",
    "GreedyState",
    "Sampling",
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
    "search",
    "searcher",
    "source_batch",
    "tile_beams",
]
