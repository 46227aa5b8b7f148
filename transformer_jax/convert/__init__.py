"""`python -m transformer_jax.convert`: the command line of transformer_jax.interop's imports."""
