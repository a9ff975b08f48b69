"""A small dataset as datasets are shipped, made here with nothing to download: a byte-level BPE
``tokenizer.json`` (the ``tokenizers`` library, trained on the text below), ``train.jsonl``,
``train.parquet`` and ``val.jsonl``, in the current folder. The README's "Your data" run
prepares and trains on them (``pip install 'cutpipe[data]'`` for tokenizers and pyarrow).
"""

from __future__ import annotations

import json
import random

import pyarrow as pa
import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

#: The sentence every line of the dataset is a stretch of (wrapping around).
SENTENCE = (
    "the pipeline runs each stage forward then backward while the next rank waits for its "
    "activation and the bubble shrinks when weight gradients fill the idle time"
)
WORDS = SENTENCE.split()


def sentences(count: int, seed: int) -> list[str]:
    """Sentences of a small grammar: word pairs repeat, so a model can learn from context."""
    rng = random.Random(seed)
    texts = []
    for _ in range(count):
        start = rng.randrange(len(WORDS))
        length = rng.randint(6, 24)
        texts.append(" ".join(WORDS[(start + i) % len(WORDS)] for i in range(length)) + ".")
    return texts


def main() -> None:
    train, held_out = sentences(4000, seed=0), sentences(400, seed=1)
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )  # fmt: skip
    tokenizer.train_from_iterator(train, trainer)
    tokenizer.save("tokenizer.json")
    with open("train.jsonl", "w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in train[:2000])
    pq.write_table(pa.table({"text": train[2000:]}), "train.parquet", row_group_size=500)
    with open("val.jsonl", "w") as file:
        file.writelines(json.dumps({"text": text}) + "\n" for text in held_out)


if __name__ == "__main__":
    main()
