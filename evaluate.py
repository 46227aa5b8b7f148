"""Command-line evaluation entry point (see README). Decoding and scoring land with the evaluation issue."""

import sys

if __name__ == "__main__":
    sys.exit("evaluate.py: evaluation is not implemented yet (tracked by the evaluation issue); nothing was run.")
