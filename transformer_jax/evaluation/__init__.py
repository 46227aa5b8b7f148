"""Evaluation: BLEU and chrF (`bleu`), checkpoint averaging (`averaging`), translating sentence lists (`translate`)."""
