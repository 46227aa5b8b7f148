"""The reserved token ids, defined once: the tokenizer reserves them, the model masks PAD, the search emits them.

They are fixed, not configurable: a SentencePiece model trained here reserves exactly these ids (data/tokenizer.py
refuses any other), batches mark padding with PAD, and decoding starts from BOS and stops at EOS.
This module sits below data/, model/ and decoding/ so that each imports it without importing the others.
"""

PAD_ID = 0  # padding: never a real token; `tokens != PAD_ID` is the default segment id of an unpacked row
EOS_ID = 1  # end of sentence: ends every source and target, and stops the search
BOS_ID = 2  # beginning of sentence: the first decoder input
UNK_ID = 3  # unknown piece (byte fallback makes it rare)
