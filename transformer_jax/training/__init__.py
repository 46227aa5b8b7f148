"""The train state with its optimiser and schedule, the loss beside the pure step functions, checkpoints, metric
writers and the training loop."""
