"""Small synthetic parallel corpora and data configs for the data-pipeline tests."""

from pathlib import Path

import numpy as np

from configs import common


def synthetic_pairs(n: int, seed: int = 0, max_words: int = 20) -> list[tuple[str, str]]:
    """Pairs whose first word names the example, with random lengths on both sides."""
    rng = np.random.default_rng(seed)
    pairs = []
    for i in range(n):
        src = " ".join([f"s{i}"] + [f"a{w}" for w in rng.integers(0, 50, rng.integers(0, max_words))])
        tgt = " ".join([f"t{i}"] + [f"b{w}" for w in rng.integers(0, 50, rng.integers(0, max_words + 5))])
        pairs.append((src, tgt))
    return pairs


def write_pairs(directory: Path, pairs: list[tuple[str, str]], split: str = "train") -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"{split}.en").write_text("".join(s + "\n" for s, _ in pairs), encoding="utf-8")
    (directory / f"{split}.de").write_text("".join(t + "\n" for _, t in pairs), encoding="utf-8")
    return directory


def config_for(directory: Path, **overrides):
    config = common.data_config()
    config.text_dir = str(directory)
    config.batch_size, config.max_len, config.batch_window = 8, 32, 256
    for key, value in overrides.items():
        config[key] = value
    return config


MULTIWAY_LANGS = ("cs", "de", "en")


def write_multiway(directory: Path, n: int = 60, langs=MULTIWAY_LANGS, blank: int | None = 3) -> Path:
    """Line i of every language is `LANG-wJ ...` for the same J's: aligned, with one blank line (line `blank`)."""
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 20, rng.integers(2, 7)) for _ in range(n)]
    directory.mkdir(parents=True, exist_ok=True)
    for split in ("train", "valid", "test"):
        for lang in langs:
            lines = ["" if i == blank else " ".join(f"{lang}{j}" for j in row) for i, row in enumerate(rows)]
            (directory / f"{split}.{lang}").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return directory
