"""Evaluation: scores (`bleu`, `significance`), a model from its averaged checkpoints (`restore`), translating
sentences (`translate`), forced decoding (`scoring`), evaluate.py's flags and records (`command`) and runs (`run`), and
validation BLEU for the trainer (`validation`)."""
