"""Evaluation: scores (`bleu`, `significance`), a model from its averaged checkpoints (`restore`), translating
sentences and validation BLEU for the trainer (`translate`), forced decoding (`scoring`), evaluate.py's flags and
records (`command`) and runs (`run`)."""
