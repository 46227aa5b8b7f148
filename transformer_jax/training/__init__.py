"""Optimiser and schedules, losses, pure step functions, checkpoints, metric writers and the training loop."""
