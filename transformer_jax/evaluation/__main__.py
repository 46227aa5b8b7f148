"""`python -m transformer_jax.evaluation`: evaluate.py's command line (evaluation/command.py)."""

from transformer_jax.evaluation.command import run_command

if __name__ == "__main__":
    run_command("python -m transformer_jax.evaluation")
