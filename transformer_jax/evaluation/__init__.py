"""Evaluation: BLEU and chrF (`bleu`), checkpoint averaging (`averaging`), a model restored from checkpoints
(`restore`), translating sentence lists (`translate`), and whole evaluation runs behind evaluate.py (`run`)."""
