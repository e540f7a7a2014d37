"""A byte-level BPE tokenizer trained on the user's text with Hugging Face
``tokenizers`` (as GPT-2's and Llama 3's are built), written as the
``tokenizer.json`` and ``tokenizer_config.json`` that the trainer and
``transformers`` read::

    python -m dsparallel.train.tokenizer --files 'docs/**/*.md' --vocab-size 2048 --out tok

The end of each document is ``<|endoftext|>``. The result is cached: the
same files (by content) and settings leave ``--out`` as it is.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys

END = "<|endoftext|>"


def _stamp(files: list[str], vocab_size: int) -> str:
    h = hashlib.sha256(f"byte-level-bpe {vocab_size}".encode())
    for path in files:
        h.update(path.encode())
        with open(path, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def train_tokenizer(files: list[str], vocab_size: int, out: str) -> str:
    """Trains (or finds cached) the tokenizer of ``files``; returns ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stamp_file = os.path.join(out, "dsparallel-stamp")
    stamp = _stamp(files, vocab_size)
    if os.path.isfile(stamp_file) and open(stamp_file).read() == stamp:
        return out
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train(files, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    settings = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": END,
        "bos_token": END,
        "model_max_length": 1 << 30,
    }
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(settings, f, indent=2)
    with open(stamp_file, "w") as f:
        f.write(stamp)
    return out


def main(argv: list[str] | None = None) -> int:
    from .data import expand

    p = argparse.ArgumentParser(prog="python -m dsparallel.train.tokenizer", description=__doc__)
    p.add_argument("--files", nargs="+", required=True, help="file patterns (** recurses)")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", required=True, help="the directory to write")
    args = p.parse_args(argv)
    files = expand(args.files, "tokenizer")
    train_tokenizer(files, args.vocab_size, args.out)
    print(f"tokenizer: {args.out} ({len(files)} files, vocabulary {args.vocab_size})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
