"""The train state with its optimiser and schedule, the loss beside the pure step functions, checkpoints, metrics
(writers, trackers, FLOPs) and the training loop."""
