"""Evaluation: BLEU and chrF (`bleu`), paired bootstrap tests (`significance`), checkpoint averaging (`averaging`),
a model restored from checkpoints (`restore`), translating sentence lists (`translate`), what to evaluate and its
checks (`options`), the inputs (`inputs`), whole evaluation runs behind evaluate.py (`run`), and validation BLEU
for the trainer (`validation`)."""
