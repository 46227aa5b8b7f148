"""Hugging Face folders -> workdirs of ours: `python -m transformer_jax.convert` (__main__.py) and `read_hf_folder`,
which picks the family's reader by config.json's model_type."""

from __future__ import annotations

import os
from pathlib import Path

from transformer_jax.errors import ConfigError, DataError
from transformer_jax.interop import m2m100, m2m100_folder, marian, marian_folder

FAMILIES = {marian.MODEL_TYPE: marian_folder.read_folder, m2m100.MODEL_TYPE: m2m100_folder.read_folder}


def read_hf_folder(folder: str | os.PathLike, *, allow_pickle: bool = False) -> marian_folder.HfFolder:
    """The checked folder of --from_hf `folder`, read by its family's reader (config.json's model_type); DataError or
    ConfigError naming the folder, the file or the key otherwise."""
    path = Path(folder)
    if not path.is_dir():
        raise DataError(f"--from_hf {folder} is not a directory; give a Hugging Face model folder")
    model_type = marian_folder.read_json(path / marian_folder.CONFIG).get("model_type")
    if model_type not in FAMILIES:
        raise ConfigError(
            f"{path / marian_folder.CONFIG} key model_type={model_type!r}: not supported; --from_hf converts "
            f"{', '.join(FAMILIES)} (Marian/OPUS-MT, M2M-100 and dense NLLB-200; not NLLB-MoE)"
        )
    return FAMILIES[model_type](path, allow_pickle=allow_pickle)
