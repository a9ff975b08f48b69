"""Hugging Face tokenizers for the data: `cutpipe data prepare --tokenizer` on text, .jsonl and
.parquet files, token files of version 2, and `cutpipe train --tokenizer`.

The tokenizer is a real byte-level BPE trained here, offline, on a few KB of text; every token
file's ids are compared with that tokenizer's own encoding of each document, followed by EOS."""

from __future__ import annotations

import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
tokenizers = pytest.importorskip("tokenizers")

from cutpipe.cli.main import main  # noqa: E402
from cutpipe.data import (  # noqa: E402
    HEADER_SIZE,
    HEADER_SIZES,
    TokenLoader,
    Tokens,
    check_data,
    dtype_for,
    load_tokenizer,
    load_tokens,
    prepare,
    read_header,
    read_tokens,
    unigram_entropy,
    write_tokens,
)
from cutpipe.data import documents as documents_module  # noqa: E402
from cutpipe.data import entropy as entropy_module  # noqa: E402
from cutpipe.data import tokenizer as tokenizer_module  # noqa: E402

WORDS = ("pipeline", "schedule", "forward", "backward", "stage", "rank", "bubble", "weight",
         "gradient", "microbatch", "token", "layer", "expert", "memory", "überall", "naïve")  # fmt: skip
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
MODEL = """\
name: bpe-lm
layers: 2
hidden: 32
heads: 2
ffn: 64
vocab: {vocab}
seq_len: 16
microbatch_size: 2
dtype: fp32
"""


def sentences(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))) for _ in range(count)]


def train_bpe(path: Path, specials: list[str], vocab_size: int) -> Path:
    """A byte-level BPE trained on a few KB of text, saved as ``path`` (a tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tokenizer.train_from_iterator(sentences(400, seed=1), trainer)
    tokenizer.save(str(path))
    return path


@pytest.fixture(scope="module")
def bpe(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """Two tokenizers (the second of another vocabulary) and one without an EOS token."""
    folder = tmp_path_factory.mktemp("tokenizers")
    main_file = train_bpe(folder / "tokenizer.json", ["<pad>", "</s>"], 300)
    other = folder / "other"
    other.mkdir()
    train_bpe(other / "tokenizer.json", ["<|endoftext|>"], 280)
    no_eos = train_bpe(folder / "no-eos.json", ["<pad>", "<sep>"], 290)
    reference = tokenizers.Tokenizer.from_file(str(main_file))
    return SimpleNamespace(file=main_file, other=other, no_eos=no_eos, reference=reference)


def expected(reference, texts: list[str], eos: int) -> list[int]:
    """The tokenizer's own encoding of each document, each followed by EOS, in order."""
    ids: list[int] = []
    for text in texts:
        ids += [*reference.encode(text, add_special_tokens=False).ids, eos]
    return ids


def write_jsonl(path: Path, texts: list[str], field: str = "text") -> None:
    with path.open("w", encoding="utf-8") as file:
        for number, text in enumerate(texts):
            file.write(json.dumps({"id": number, field: text}) + "\n")
            if number == 2:
                file.write("\n")  # a blank line is passed over


def write_parquet(path: Path, texts: list, row_group_size: int = 4) -> None:
    table = pa.table({"id": list(range(len(texts))), "text": texts})
    pq.write_table(table, path, row_group_size=row_group_size)


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- preparing ----------------------------------------------------------------------------------


def test_a_folder_of_text_jsonl_and_parquet_is_each_document_then_eos(bpe, tmp_path, monkeypatch):
    """Documents in the folder's sorted order: a text file whole, a .jsonl line, a .parquet row
    (read 3 rows at a time across row groups of 4); empty ones left out."""
    monkeypatch.setattr(documents_module, "PARQUET_BATCH", 3)
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    lines, rows, text = sentences(7, seed=2), sentences(11, seed=3), "\n".join(sentences(5, 4))
    write_jsonl(corpus / "a.jsonl", lines)
    write_parquet(corpus / "b.parquet", [*rows[:5], "", *rows[5:]])
    (corpus / "c.txt").write_text(text, encoding="utf-8")
    tokenizer = load_tokenizer(bpe.file)
    eos = bpe.reference.token_to_id("</s>")
    assert (tokenizer.eos, tokenizer.eos_token, tokenizer.vocab) == (eos, "</s>", 300)
    assert tokenizer.digest == hashlib.sha256(bpe.reference.to_str().encode()).hexdigest()

    done = prepare([corpus], tmp_path / "t.bin", tokenizer=tokenizer, workers=2)
    want = expected(bpe.reference, [*lines, *rows, text], eos)
    header = read_header(tmp_path / "t.bin")
    assert (header.version, header.dtype, header.vocab, header.count) == (2, "uint16", 300,
                                                                         len(want))  # fmt: skip
    assert (header.tokenizer, header.eos, done.files) == (tokenizer.digest, eos, 3)
    assert (tmp_path / "t.bin").stat().st_size == HEADER_SIZES[2] + 2 * len(want)
    tokens = read_tokens(tmp_path / "t.bin")
    assert tokens.values.dtype == torch.uint16 and tokens.values.tolist() == want
    assert (tokens.tokenizer, tokens.eos) == (tokenizer.digest, eos)

    # one thread or several, from the API or the command line: the same file
    prepare([corpus], tmp_path / "one.bin", tokenizer=tokenizer, workers=1)
    assert (tmp_path / "one.bin").read_bytes() == (tmp_path / "t.bin").read_bytes()


def test_the_command_line_prepares_and_describes_a_parquet_file(bpe, tmp_path, capsys, monkeypatch):
    rows = sentences(9, seed=5)
    write_parquet(tmp_path / "rows.parquet", rows)
    code, out, _ = run(capsys, "data", "prepare", str(tmp_path / "rows.parquet"), "--tokenizer",
                       str(bpe.file.parent), "--workers", "2", "-o", str(tmp_path / "r.bin"),
                       "--json")  # fmt: skip
    assert code == 0, out
    done = json.loads(out)
    eos = bpe.reference.token_to_id("</s>")
    want = expected(bpe.reference, rows, eos)
    digest = hashlib.sha256(bpe.reference.to_str().encode()).hexdigest()
    assert (done["tokens"], done["dtype"], done["eos"], done["tokenizer"]) == (
        len(want), "uint16", eos, digest)  # fmt: skip
    assert read_tokens(tmp_path / "r.bin").values.tolist() == want
    code, out, _ = run(capsys, "data", "info", str(tmp_path / "r.bin"))
    assert code == 0
    assert f"tokenizer        {digest}" in out and f"eos              {eos}" in out
    assert "vocab            300 (uint16)" in out
    # on a terminal a progress bar goes to stderr, and the file is the same
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    code, out, _ = run(capsys, "data", "prepare", str(tmp_path / "rows.parquet"), "--tokenizer",
                       str(bpe.file), "-o", str(tmp_path / "bar.bin"))  # fmt: skip
    assert code == 0 and out.startswith(f"wrote {tmp_path / 'bar.bin'}: {len(want):,} tokens")
    assert (tmp_path / "bar.bin").read_bytes() == (tmp_path / "r.bin").read_bytes()


def test_a_named_eos_and_a_model_folders_config_choose_the_eos(bpe, tmp_path):
    pad = bpe.reference.token_to_id("<pad>")
    assert load_tokenizer(bpe.file, eos="<pad>").eos == pad
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes(bpe.file.read_bytes())
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<pad>"}}))
    assert load_tokenizer(folder).eos_token == "<pad>"
    (tmp_path / "a.txt").write_text("pipeline stage")
    prepare([tmp_path / "a.txt"], tmp_path / "t.bin", tokenizer=load_tokenizer(folder))
    assert read_tokens(tmp_path / "t.bin").values.tolist() == expected(
        bpe.reference, ["pipeline stage"], pad)  # fmt: skip


def test_text_tokenized_in_memory_is_the_token_file(bpe, tmp_path):
    """What a training run given text and --tokenizer trains on: the token file's ids, under
    the same fingerprint (so a run may resume from the file prepared from its text)."""
    lines = sentences(20, seed=6)
    write_jsonl(tmp_path / "a.jsonl", lines)
    prepare([tmp_path / "a.jsonl"], tmp_path / "t.bin", tokenizer=load_tokenizer(bpe.file))
    from_file = read_tokens(tmp_path / "t.bin")
    in_memory = load_tokens([tmp_path / "a.jsonl"], tokenizer=bpe.file)
    assert in_memory.values.tolist() == from_file.values.tolist()
    assert (in_memory.fingerprint, in_memory.vocab, in_memory.tokenizer, in_memory.eos) == (
        from_file.fingerprint, 300, from_file.tokenizer, from_file.eos)  # fmt: skip
    summary = check_data([tmp_path / "a.jsonl"], tokenizer=bpe.file, seq_len=8)
    assert str(summary) == (
        f"data: {len(from_file):,} tokens of the tokenizer {from_file.tokenizer[:16]} of text "
        f"from 1 file of {tmp_path / 'a.jsonl'}"
    )
    assert (summary.tokens, summary.digest, summary.vocab) == (len(from_file),
                                                               from_file.fingerprint, 300)  # fmt: skip


# -- token files --------------------------------------------------------------------------------


def test_bytes_still_make_version_1_files_and_records_are_documents(tmp_path):
    """Without a tokenizer nothing changes for text (version 1, 64-byte header, bytes), and the
    records of .jsonl and .parquet files are documents joined by NUL as files are."""
    (tmp_path / "a.txt").write_text("plain text")
    write_jsonl(tmp_path / "b.jsonl", ["first", "second"])
    write_parquet(tmp_path / "c.parquet", ["third", None][:1])
    done = prepare([tmp_path / "a.txt", tmp_path / "b.jsonl", tmp_path / "c.parquet"],
                   tmp_path / "t.bin")  # fmt: skip
    data = b"plain text\0first\0second\0third"
    assert (done.header.version, done.header.dtype, done.header.tokenizer) == (1, "uint8", "bytes")
    assert (tmp_path / "t.bin").read_bytes()[HEADER_SIZE:] == data
    assert done.header.digest == hashlib.sha256(data).hexdigest()
    tokens = read_tokens(tmp_path / "t.bin")
    assert (tokens.tokenizer, tokens.eos, bytes(tokens.values.tolist())) == ("bytes", None, data)


@pytest.mark.parametrize(("vocab", "dtype"), [(1, "uint8"), (256, "uint8"), (257, "uint16"),
                                              (2**16, "uint16"), (2**16 + 1, "uint32")])  # fmt: skip
def test_the_dtype_is_the_narrowest_that_holds_the_vocabulary(vocab, dtype):
    assert dtype_for(vocab) == dtype


def test_uint32_tokens_round_trip_and_batch_as_int64(tmp_path, monkeypatch):
    ids = torch.tensor([70_000, 5, 65_536, 1, 99_999, 2, 3, 70_001, 4, 0, 12], dtype=torch.int64)
    raw = ids.to(torch.int32).numpy().tobytes()  # little-endian, as token files are
    digest = "ab" * 32
    header = write_tokens(tmp_path / "t.bin", [raw[:8], raw[8:]], 100_000, digest, eos=2)
    assert (header.version, header.dtype, header.count, header.eos) == (2, "uint32", 11, 2)
    tokens = read_tokens(tmp_path / "t.bin")
    assert tokens.values.dtype == torch.uint32 and tokens.values.long().tolist() == ids.tolist()
    assert tokens.fingerprint == Tokens.from_tensor(tokens.values.clone()).fingerprint
    loader = TokenLoader(tokens, seq_len=2, batch_size=5, seed=0)
    inputs, targets = next(loader)
    assert inputs.dtype == targets.dtype == torch.int64
    starts = [ids.tolist().index(int(row[0])) for row in inputs]
    assert inputs.tolist() == [ids[s : s + 2].tolist() for s in starts]
    assert targets.tolist() == [ids[s + 1 : s + 3].tolist() for s in starts]
    # the unigram entropy counts wide tokens a block at a time, blocks merged
    monkeypatch.setattr(entropy_module, "_BLOCK", 3)
    counts = torch.bincount(ids).double()
    shares = counts[counts > 0] / len(ids)
    assert unigram_entropy(tokens) == pytest.approx(float(-(shares * shares.log()).sum()))
    with pytest.raises(ValueError, match="end-of-sequence id"):
        write_tokens(tmp_path / "u.bin", [raw], 100_000, digest, eos=100_000)


@pytest.mark.parametrize(
    ("how", "message"),
    [("eos", "end-of-sequence token is 400, outside its vocabulary of 300"),
     ("short", "shorter than the 128-byte header of version 2"),
     ("v1 wide", "version 1 holds bytes (uint8) only"),
     ("tokens", "damaged: its tokens do not match the digest")],
)  # fmt: skip
def test_a_damaged_version_2_file_is_refused(tmp_path, how, message):
    raw = bytes(range(40))  # 20 uint16 tokens
    write_tokens(tmp_path / "t.bin", [raw], 300, "cd" * 32, eos=7)
    data = bytearray((tmp_path / "t.bin").read_bytes())
    if how == "eos":
        data[96:100] = (400).to_bytes(4, "little")
    elif how == "short":
        data = data[:100]
    elif how == "v1 wide":
        data[8:12] = (1).to_bytes(4, "little")
    else:
        data[-1] ^= 1
    (tmp_path / "t.bin").write_bytes(bytes(data))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_tokens(tmp_path / "t.bin")


# -- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("content", "message"),
    [('{"text": "a"}\n{"body": "b"}\n', "a.jsonl:2 has no 'text' field"),
     ('{"text": "a"}\nnot json\n', "a.jsonl:2 is not JSON"),
     ('["text"]\n', "a.jsonl:1 has no 'text' field"),
     ('{"text": 3}\n', "a.jsonl:1: its 'text' is int, not text")],
)  # fmt: skip
def test_a_bad_jsonl_line_is_one_line_naming_file_and_line(
    capsys, tmp_path, monkeypatch, bpe, content, message
):
    (tmp_path / "a.jsonl").write_text(content)
    monkeypatch.chdir(tmp_path)
    for tokenizer in ([], ["--tokenizer", str(bpe.file)]):
        code, out, err = run(capsys, "data", "prepare", "a.jsonl", "-o", "t.bin", *tokenizer)
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "t.bin").exists()


def test_bad_parquet_files_and_tokenizers_are_one_line(capsys, tmp_path, monkeypatch, bpe):
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.table({"body": ["a"]}), "cols.parquet")
    write_parquet(tmp_path / "nulls.parquet", ["a", "b", None])
    pq.write_table(pa.table({"text": [1, 2]}), "ints.parquet")
    Path("fake.parquet").write_text("not parquet")
    Path("a.txt").write_text("some text")
    Path("broken.json").write_text("{")
    cases = [
        (["cols.parquet"], "cols.parquet has no 'text' column (it has body)"),
        (["nulls.parquet"], "nulls.parquet: row 3 has no 'text' (null)"),
        (["ints.parquet"], "its 'text' column holds int64, not text"),
        (["fake.parquet"], "fake.parquet is not a parquet file"),
        (["a.txt", "--tokenizer", str(bpe.no_eos)], "cannot tell its end-of-sequence token"),
        (["a.txt", "--tokenizer", str(bpe.file), "--eos", "<none>"], "--eos <none>: "),
        (["a.txt", "--eos", "</s>"], "give --tokenizer too"),
        (["a.txt", "--tokenizer", str(tmp_path)], "holds no tokenizer.json"),
        (["a.txt", "--tokenizer", "broken.json"], "broken.json is not a Hugging Face tokenizer"),
    ]
    for args, message in cases:
        code, out, err = run(capsys, "data", "prepare", *args, "-o", "t.bin")
        assert code == 2 and out == "" and err.count("\n") == 1 and message in err, (args, err)
    assert "<pad>, <sep>" in run(capsys, "data", "prepare", "a.txt", "--tokenizer",
                                 str(bpe.no_eos), "-o", "t.bin")[2]  # fmt: skip
    assert not Path("t.bin").exists()


def test_a_missing_library_says_how_to_install_it(capsys, tmp_path, bpe, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_parquet(tmp_path / "rows.parquet", ["a"])
    Path("a.txt").write_text("some text")
    tokenizer_module._load.cache_clear()  # loaded before the library went missing
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    monkeypatch.setitem(sys.modules, "pyarrow", None)
    for args, what in ((["a.txt", "--tokenizer", str(bpe.file)], "--tokenizer needs the tokenizers"),
                       (["rows.parquet"], "needs the pyarrow package")):  # fmt: skip
        code, _out, err = run(capsys, "data", "prepare", *args, "-o", "t.bin")
        assert code == 2 and err.count("\n") == 1 and what in err, err
        assert "pip install 'cutpipe[data]'" in err
    tokenizer_module._load.cache_clear()


# -- training -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def token_file(bpe, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("data")
    write_jsonl(folder / "train.jsonl", sentences(120, seed=7))
    prepare([folder / "train.jsonl"], folder / "train.bin", tokenizer=load_tokenizer(bpe.file))
    return folder / "train.bin"


def model_file(folder: Path, vocab: int) -> str:
    path = folder / f"model-{vocab}.yaml"
    path.write_text(MODEL.format(vocab=vocab))
    return str(path)


def test_the_launcher_refuses_another_tokenizer_or_a_small_vocab(capsys, tmp_path, bpe,
                                                                 token_file):  # fmt: skip
    """Before any worker starts: exit status 2 and one line naming both tokenizers, or what to
    change about the vocabulary."""
    common = ["train", "--nproc", "2", "--schedule", "1f1b", "--data", str(token_file)]
    code, _, err = run(capsys, *common, "--model", model_file(tmp_path, 300),
                         "--tokenizer", str(bpe.other))  # fmt: skip
    theirs = load_tokenizer(bpe.file).digest[:16]
    ours = load_tokenizer(bpe.other).digest[:16]
    assert code == 2 and err.count("\n") == 1, err
    assert f"the tokenizer {theirs}, --tokenizer {bpe.other} is {ours}" in err
    code, _, err = run(capsys, *common, "--model", model_file(tmp_path, 256))
    assert code == 2 and err.count("\n") == 1, err
    assert "a vocabulary of 300, larger than the model's vocab 256: set the model's vocab" in err
    (tmp_path / "a.txt").write_text("text of bytes " * 20)
    code, _out, err = run(capsys, *common[:5], "--data", str(tmp_path / "a.txt"),
                         "--model", model_file(tmp_path, 200))  # fmt: skip
    assert (
        code == 2 and "byte tokens, a vocabulary of 256, larger than the model's vocab 200" in err
    )


def test_a_resume_with_another_tokenizer_is_refused(bpe, tmp_path):
    """The run record names the tokenizer that made the tokens (its digest, or bytes)."""
    from cutpipe.train.options import TrainOptions
    from cutpipe.train.resume import differences, run_record
    from cutpipe.train.tasks import task_for

    write_jsonl(tmp_path / "a.jsonl", sentences(60, seed=8))
    layout = SimpleNamespace(batch=2, schedule=SimpleNamespace(name="1f1b", num_microbatches=1),
                             dp=1, ep=1)  # fmt: skip
    records = []
    for tokenizer, vocab in ((bpe.file, 300), (bpe.other, 300), (None, 300)):
        options = TrainOptions.build(
            model=model_file(tmp_path, vocab), data=(str(tmp_path / "a.jsonl"),),
            tokenizer=None if tokenizer is None else str(tokenizer),
        )  # fmt: skip
        task = task_for(options)
        task.loader(2, seed=0)
        records.append(run_record(options, task, layout))
    assert records[0]["tokenizer"] == load_tokenizer(bpe.file).digest
    assert records[2]["tokenizer"] == "bytes"
    for other in records[1:]:
        found = differences(records[0], other)
        assert set(found.refused) == {"tokenizer"}
        with pytest.raises(ValueError, match="another run \\(tokenizer "):
            found.check(2)


@pytest.mark.timeout(300)
def test_training_on_a_tokenizers_token_file_runs_end_to_end(bpe, tmp_path, token_file):
    command = [sys.executable, "-m", "cutpipe", "train", "--quiet", "--nproc", "2", "--schedule",
               "1f1b", "--tokenizer", str(bpe.file), "--data", str(token_file), "--model",
               model_file(tmp_path, 300), "--steps", "2", "-m", "2", "--global-batch", "4",
               "--metrics", str(tmp_path / "m.jsonl")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r and r.get("step")]
    assert len(losses) == 2 and all(0 < loss < 10 for loss in losses), records
    assert "2 steps: loss" in done.stdout
