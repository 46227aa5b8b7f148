"""The reserved token ids, a property of the vocabulary: one frozen record read from the `model.*_id` config keys.

A SentencePiece model trained here reserves `DEFAULT` (pad 0, eos 1, bos 2, unk 3); a converted Marian model keeps
its own (eos 0, unk 1, pad = bos = vocab_size - 1: its decoder starts from pad). Since bos may equal pad, whether a
target position is real comes from the batch's segment ids or lengths, never from `tokens != pad`. This module sits
below data/, model/ and decoding/ so that each imports it without importing the others.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import ml_collections

FIELDS = ("pad", "eos", "bos", "unk")  # each the config key model.{field}_id


@dataclasses.dataclass(frozen=True)
class SpecialIds:
    """The reserved ids of one vocabulary (hashable: a static argument of jitted functions)."""

    pad: int  # padding: never a real token, never emitted by the search
    eos: int  # end of sentence: ends every source and target, and stops the search
    bos: int  # the first decoder input (may equal pad, as Marian's decoder_start_token_id does)
    unk: int  # unknown piece

    DEFAULT: ClassVar[SpecialIds]

    @classmethod
    def of(cls, config: Any) -> SpecialIds:
        """The ids of a full config (its `model` group), of the `model` group itself, or of a TransformerSpec."""
        model = config.model if isinstance(config, ml_collections.ConfigDict) and "model" in config else config
        return cls(*(int(getattr(model, f"{field}_id")) for field in FIELDS))


SpecialIds.DEFAULT = SpecialIds(pad=0, eos=1, bos=2, unk=3)
