"""transformer_jax: the encoder-decoder Transformer of "Attention Is All You Need" in JAX/Flax NNX.

Axis letters. Array names end in their axes (`logits_BTV`, `q_BTNH`); a letter means the same thing in every file
of the package, and each file's docstring cites this legend instead of defining its own:

    B  batch rows (sentences or packed rows)     D  d_model                 N  query heads
    T  target / query length                     F  d_ff (FFN hidden)       K  key/value heads
    S  source / key-value length                 V  vocabulary              G  query heads per key/value head (N = K G)
    L  decoding cache slots (= max output steps) H  query/key head dim d_k  E  value head dim d_v
    W  beams per sentence                        R  beam rows, R = B W (row b W + w is beam w of sentence b)
    X  query block, Y key block (tiled kernels); I query blocks (T / X), J key blocks (S / Y)
    M  segments (packed sequences)               Z  frequencies of the sinusoidal encoding (D / 2)
    P  positions (pictures of the positional encoding)  C  candidates each beam proposes (beam search, min(W, V))

Importing the package configures nothing (no jax setting, no environment variable): the command lines do
(cli.parse_flags turns the persistent compilation cache on).
"""

__version__ = "0.1.0"
