"""Evaluation: BLEU and chrF (`bleu`), paired bootstrap tests (`significance`), a model restored from its averaged
checkpoints (`restore`), translating sentence lists (`translate`), evaluate.py's flags, the mode records they become
and their checks (`command`), whole evaluation runs behind evaluate.py (`run`), and validation BLEU for the trainer
(`validation`)."""
