"""CTranslate2's side of `benchmarks.fresh_process`: a whole process that loads an exported model and translates a
file, as a CTranslate2 user's script would.

    python -m benchmarks.ctranslate2_process JOB.json

JOB (written by benchmarks/fresh_process.py): the export directory, the SentencePiece model, the source file, the
output file, each line's output limit (our rule, evaluation.translate.output_limit, computed by the caller so that
it has one source), the beam size, length penalty, batch size, threads (intra_threads) and inter_threads (1 if
absent). It imports ctranslate2 and
sentencepiece only: importing transformer_jax would import JAX, which a CTranslate2 user does not pay for.
Sources are SentencePiece pieces without EOS (the engine adds it), cut to the job's max_input_pieces; blank lines
give blank outputs. With "one_call" false: one call per distinct limit, as interop.ctranslate2.ctranslate2_translate
makes for beam search (the engine's max_decoding_length is one number per call and counts the EOS it stops at), so that
each output has our limit; with "one_call" true: one call with the largest limit, as a CTranslate2 user would make
it (better batches; a beam output can then differ from ours where a sentence reaches its limit).
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict

import ctranslate2
import sentencepiece as spm


def main(job_file: str) -> None:
    with open(job_file, encoding="utf-8") as f:
        job = json.load(f)
    translator = ctranslate2.Translator(
        job["model_dir"], device="cpu", inter_threads=job.get("inter_threads", 1), intra_threads=job["threads"]
    )
    sp = spm.SentencePieceProcessor(model_file=job["spm_model"])
    with open(job["source_file"], encoding="utf-8", newline="\n") as f:
        lines = f.read().split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    groups: dict[int, list[int]] = defaultdict(list)
    pieces: dict[int, list[str]] = {}
    for i, (line, limit) in enumerate(zip(lines, job["limits"], strict=True)):
        if line.strip():
            pieces[i] = sp.encode(line, out_type=str)[: job["max_input_pieces"]]
            groups[max(job["limits"]) if job["one_call"] else limit].append(i)
    outputs = [""] * len(lines)
    for limit, rows in sorted(groups.items()):
        results = translator.translate_batch(
            [pieces[i] for i in rows],
            max_batch_size=job["batch_size"],
            beam_size=job["beam_size"],
            length_penalty=job["alpha"],
            max_input_length=0,
            max_decoding_length=limit,
            min_decoding_length=0,
        )
        for i, result in zip(rows, results, strict=True):
            outputs[i] = sp.decode(result.hypotheses[0])
    with open(job["output_file"], "w", encoding="utf-8", newline="\n") as f:
        f.write("".join(f"{line}\n" for line in outputs))


if __name__ == "__main__":
    main(sys.argv[1])
