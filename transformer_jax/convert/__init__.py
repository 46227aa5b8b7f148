"""Models of other toolkits into workdirs of ours: `python -m transformer_jax.convert --from_marian DIR --workdir W`.

marian.py holds the one mapping between Hugging Face Marian (OPUS-MT) and our parameters and config, used by this
import and by the export (transformer_jax.export.marian); folder.py reads a Marian folder and writes the workdir.
"""
