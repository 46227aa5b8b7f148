"""Models of other toolkits to and from workdirs of ours; the command lines are transformer_jax.convert and .export.

marian.py: Hugging Face Marian's one table of parameter names and its config, both ways; marian_folder.py: a Marian
folder read into a workdir and written from one; ctranslate2.py: the CTranslate2 export and decoding with our
length limits; folders.py: what the formats share (the checked restore, the output directory written whole).
"""
