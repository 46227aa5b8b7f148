"""Command-line training entry point (see README). The training loop lands with the training issue."""

import sys

if __name__ == "__main__":
    sys.exit("train.py: training is not implemented yet (tracked by the training issue); nothing was run.")
