"""See the mathematics run: one sentence through every equation of a trained model, written as one HTML page.

    python -m transformer_jax.explain --workdir runs/m30k "A man is riding a bike." [--target "..."]
        [--layer 0 --head 1] [--output explain.html] [--lang en|hi] [--checkpoint latest|STEP] [--average_last N]
        [--beam_size W] [--alpha A]

The model is restored and the sentence translated exactly as evaluate.py does (same checkpoint averaging and
decoding settings, from the saved config unless a flag says otherwise). The page is self-contained (images inlined,
no script, no network). A short summary is printed. A bad argument is one line on stderr, exit status 1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from absl import flags

from transformer_jax.cli import exit_on_user_error, fail, parse_flags
from transformer_jax.errors import VisualizeError
from transformer_jax.evaluation.restore import CheckpointChoice
from transformer_jax.explain.capture import check_sentence, explain
from transformer_jax.explain.page import figures, render, summary
from transformer_jax.explain.text import LANGUAGES
from transformer_jax.runtime import check_writable

PROG = "python -m transformer_jax.explain"


def _flag_values() -> flags.FlagValues:
    """The flags, in a FlagValues of their own: importing this module defines nothing in the global absl FLAGS."""
    fv = flags.FlagValues()
    on = {"flag_values": fv}
    flags.DEFINE_string("workdir", None, "training directory with checkpoints/ and spm.model", **on)
    flags.DEFINE_string("target", None, "target sentence fed to the decoder; default the model's translation", **on)
    flags.DEFINE_integer("layer", 0, "layer shown in detail (0-based; encoder and decoder)", **on)
    flags.DEFINE_integer("head", 0, "attention head shown in detail (0-based)", **on)
    flags.DEFINE_string("output", "explain.html", "the HTML page to write", **on)
    flags.DEFINE_enum("lang", "en", LANGUAGES, "language of the headings and explanations", **on)
    flags.DEFINE_string("checkpoint", "latest", "latest, or a checkpoint step (as evaluate.py)", **on)
    flags.DEFINE_integer("average_last", None, "average the last N checkpoints; default config.eval.average_last", **on)
    flags.DEFINE_integer("beam_size", None, "beam size (1: greedy); default config.eval.beam_size", **on)
    flags.DEFINE_float("alpha", None, "length penalty exponent; default config.eval.alpha", **on)
    return fv


def main(argv: Sequence[str] | None = None) -> int:
    """argv: the sentence and the flags (sys.argv[1:] when None). Writes the page and prints a summary."""
    argv = [PROG, *(sys.argv[1:] if argv is None else argv)]
    fv = _flag_values()
    rest = parse_flags(PROG, argv, fv, usage=__doc__)[1:]
    if fv.workdir is None:
        fail(PROG, "--workdir is required: the training directory of the model to explain")
    if len(rest) != 1:
        got = "no sentence" if not rest else f"{len(rest)} arguments {rest}"
        fail(PROG, f'{got}; give exactly one sentence, in quotes: {PROG} --workdir DIR "A man is riding a bike."')
    with exit_on_user_error(PROG):
        check_sentence(rest[0])
        output = Path(fv.output)
        if output.suffix.lower() not in (".html", ".htm"):
            raise VisualizeError(f"--output {output}: the page is HTML; give a file name ending in .html")
        check_writable(output, "--output")
        x = explain(
            fv.workdir, rest[0], target=fv.target, layer=fv.layer, head=fv.head,
            choice=CheckpointChoice(fv.checkpoint, fv.average_last), beam_size=fv.beam_size, alpha=fv.alpha,
        )  # fmt: skip
        f = figures(x)
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(render(x, f, fv.lang), encoding="utf-8")
    print(summary(x, f))
    print(f"wrote {output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
