"""`python -m transformer_jax.export`: the command line of transformer_jax.interop's exports."""
