"""cutpipe.data: corpora, token files, the unigram entropy, the seeded loader, `cutpipe data`."""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cutpipe.cli.main import main
from cutpipe.data import (
    HEADER_SIZE,
    SEPARATOR,
    STDLIB_BYTES,
    TokenLoader,
    Tokens,
    check_data,
    check_digest,
    check_token_file,
    load_tokens,
    nats_to_bits,
    prepare,
    read_header,
    read_tokens,
    stdlib_sources,
    unigram_entropy,
    user_sources,
    write_tokens,
)


def random_bytes(count: int, seed: int = 0) -> bytes:
    return random.Random(seed).randbytes(count)


def token_file(tmp_path: Path, data: bytes, name: str = "t.bin") -> Path:
    path = tmp_path / name
    write_tokens(path, [data[:7], data[7:]])
    return path


def run(capsys, *args: str) -> tuple[int, str, str]:
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


# -- token files --------------------------------------------------------------------------------


def test_a_token_file_round_trips_with_its_header(tmp_path):
    data = b"pipeline schedules\n" * 10
    path = token_file(tmp_path, data)
    header = read_header(path)
    assert (header.count, header.vocab, header.dtype, header.version) == (
        len(data),
        256,
        "uint8",
        1,
    )
    assert header.digest == hashlib.sha256(data).hexdigest()
    assert path.stat().st_size == HEADER_SIZE + len(data)
    tokens = read_tokens(path)
    assert bytes(tokens.values.tolist()) == data
    assert tokens.fingerprint == header.digest == Tokens.from_bytes(data).fingerprint
    check_digest(path, tokens)


def corrupt(path: Path, how: str) -> None:
    raw = bytearray(path.read_bytes())
    if how == "text":
        raw = bytearray(b"just some text, not tokens\n")
    elif how == "empty":
        raw = bytearray()
    elif how == "short header":
        raw = raw[:20]
    elif how == "short body":
        raw = raw[:-3]
    elif how == "extra bytes":
        raw += b"more"
    elif how == "version":
        struct.pack_into("<I", raw, 8, 3)
    elif how == "dtype":
        raw[12:20] = b"int64\0\0\0"
    elif how == "vocab":
        struct.pack_into("<I", raw, 28, 1000)
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("how", "message"),
    [("text", "not a cutpipe token file"), ("empty", "not a cutpipe token file"),
     ("short header", "truncated: 20 bytes"), ("short body", "truncated: its header says 50"),
     ("extra bytes", "4 bytes after its 50 tokens"), ("version", "version 3 token file"),
     ("dtype", "dtype 'int64'"), ("vocab", "1000 tokens")],
)  # fmt: skip
def test_a_damaged_token_file_is_refused_saying_what_to_do(tmp_path, how, message):
    path = token_file(tmp_path, random_bytes(50))
    corrupt(path, how)
    with pytest.raises(ValueError, match=message) as error:
        read_tokens(path)
    assert "prepare" in str(error.value)


def test_missing_files_folders_and_changed_tokens_are_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        read_header(tmp_path / "none.bin")
    with pytest.raises(ValueError, match="is a folder"):
        read_header(tmp_path)
    path = token_file(tmp_path, random_bytes(50))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="damaged: its tokens do not match the digest"):
        check_digest(path, read_tokens(path))


def test_an_empty_corpus_writes_no_file(tmp_path):
    with pytest.raises(ValueError, match="empty"):
        write_tokens(tmp_path / "t.bin", [b"", b""])
    assert list(tmp_path.iterdir()) == []


# -- corpora ------------------------------------------------------------------------------------


def make_tree(root: Path) -> Path:
    """b/ before b.txt, binaries and dot-names that a walk skips, nesting."""
    (root / "b").mkdir(parents=True)
    (root / "b" / "z.py").write_bytes(b"z = 1\n")
    (root / "b.txt").write_bytes(b"bee\n")
    (root / "a.md").write_bytes(b"# a\n")
    (root / "image.png").write_bytes(b"\x89PNG\r\n\x1a\n\0\0\0")
    (root / ".hidden").write_bytes(b"secret\n")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_bytes(b"[core]\n")
    (root / "empty.txt").write_bytes(b"")
    return root


def test_folders_are_walked_in_sorted_order_skipping_binaries_and_dot_names(tmp_path):
    root = make_tree(tmp_path / "corpus")
    names = [s.name.removeprefix(f"{root.as_posix()}/") for s in user_sources([root])]
    assert names == ["a.md", "b/z.py", "b.txt", "empty.txt", "image.png"]
    tokens = load_tokens([root])
    assert bytes(tokens.values.tolist()) == SEPARATOR.join([b"# a\n", b"z = 1\n", b"bee\n"])


def test_named_files_keep_their_order_once_each_and_must_be_text(tmp_path):
    root = make_tree(tmp_path / "corpus")
    sources = user_sources([root / "b.txt", root, root / "b.txt"])
    assert sources[0].name.endswith("b.txt") and len(sources) == 5
    with pytest.raises(ValueError, match="image.png is not a text file"):
        load_tokens([root / "image.png"])
    with pytest.raises(ValueError, match="no such file or folder"):
        load_tokens([root / "missing.txt"])
    (tmp_path / "void").mkdir()
    with pytest.raises(ValueError, match="no text in"):
        load_tokens([tmp_path / "void"])


def test_a_size_cap_keeps_the_first_bytes(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"0123456789")
    (tmp_path / "b.txt").write_bytes(b"abcdef")
    assert bytes(load_tokens([tmp_path], max_bytes=13).values.tolist()) == b"0123456789\0ab"
    path = tmp_path / "out.bin"
    assert prepare([tmp_path / "a.txt", tmp_path / "b.txt"], path, max_bytes=4).files == 1
    assert read_header(path).count == 4


def test_text_and_its_token_file_have_the_same_fingerprint(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text\n")
    prepared = prepare([tmp_path / "src"], tmp_path / "t.bin")
    from_file, from_text = load_tokens(tmp_path / "t.bin"), load_tokens([tmp_path / "src"])
    assert from_file.fingerprint == from_text.fingerprint == prepared.header.digest
    with pytest.raises(ValueError, match="give it alone"):
        load_tokens([tmp_path / "t.bin", tmp_path / "src"])


def test_the_standard_library_corpus_is_stable_and_capped(tmp_path):
    sources = stdlib_sources()
    assert sources == stdlib_sources() and len(sources) > 100
    names = [s.name for s in sources]
    assert names == sorted(names, key=lambda name: Path(name).parts)
    assert not [n for n in names if {"site-packages", "test", "tests"} & set(Path(n).parts)]
    assert all(name.endswith(".py") for name in names)
    done = prepare([], tmp_path / "std.bin")
    assert 2**20 < done.header.count <= STDLIB_BYTES
    assert load_tokens().fingerprint == done.header.digest
    assert 2.0 < unigram_entropy(read_tokens(tmp_path / "std.bin")) < math.log(256)


# -- entries that are not files, binaries found early, damaged and empty data -----------------

needs_fifo = pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes here")


def odd_tree(root: Path) -> Path:
    """Text beside a named pipe, a socket, a broken link and a huge sparse binary file: none of
    them may be opened (a pipe blocks, the sparse file is 64 GiB of NULs)."""
    root.mkdir()
    (root / "a.txt").write_bytes(b"alpha\n")
    (root / "z.txt").write_bytes(b"omega\n")
    os.mkfifo(root / "pipe")
    with socket.socket(socket.AF_UNIX) as listener:  # a relative path: socket names are short
        listener.bind(os.path.relpath(root / "sock"))
    (root / "broken").symlink_to(root / "nowhere")
    with (root / "sparse.img").open("wb") as file:
        file.truncate(64 * 2**30)
    return root


@needs_fifo
@pytest.mark.timeout(60)
def test_pipes_sockets_links_and_sparse_binaries_in_a_folder_are_skipped_and_counted(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    root = odd_tree(tmp_path / "corpus")
    expected = b"alpha\n" + SEPARATOR + b"omega\n"
    assert bytes(load_tokens([root]).values.tolist()) == expected
    done = prepare([root], tmp_path / "t.bin")
    assert done.files == 2 and done.header.count == len(expected)
    line = "1 binary file, 1 named pipe, 1 socket, 1 unreadable file"
    assert str(done.skipped) == line
    summary = check_data([root])
    assert (summary.kind, summary.tokens, summary.files) == ("text", len(expected), 2)
    assert summary.digest == hashlib.sha256(expected).hexdigest() == done.header.digest
    assert str(summary).endswith(f"skipped {line}") and "\n" not in str(summary)
    code, out, _ = run(capsys, "data", "prepare", str(root), "-o", str(tmp_path / "u.bin"))
    assert code == 0 and f"\nskipped {line}\n" in out
    code, out, _ = run(capsys, "data", "prepare", str(root), "-o", str(tmp_path / "u.bin"),
                       "--json")  # fmt: skip
    skipped = json.loads(out)["skipped"]
    assert skipped == {"binary": 1, "pipe": 1, "socket": 1, "unreadable": 1}


@needs_fifo
@pytest.mark.timeout(60)
def test_a_pipe_named_as_data_is_refused_by_name(tmp_path, capsys):
    pipe = tmp_path / "pipe"
    os.mkfifo(pipe)
    for read in (load_tokens, check_data, lambda paths: prepare(paths, tmp_path / "t.bin")):
        with pytest.raises(ValueError, match=r"pipe is a named pipe \(FIFO\), not a file"):
            read([pipe])
    with pytest.raises(ValueError, match=r"pipe is a named pipe \(FIFO\): give a token file"):
        read_header(pipe)
    for args in (["prepare", str(pipe), "-o", str(tmp_path / "t.bin")], ["info", str(pipe)]):
        code, out, err = run(capsys, "data", *args)
        assert code == 2 and out == "" and err.count("\n") == 1 and "named pipe (FIFO)" in err
    assert not (tmp_path / "t.bin").exists()


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0, reason="permissions do not bind root"
)
def test_unreadable_files_and_folders_are_skipped_inside_folders_and_refused_by_name(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"text\n")
    (tmp_path / "locked.txt").write_bytes(b"secret\n")
    (tmp_path / "closed").mkdir()
    (tmp_path / "locked.txt").chmod(0)
    (tmp_path / "closed").chmod(0)
    try:
        done = prepare([tmp_path], tmp_path / "t.out")
        assert str(done.skipped) == "1 unreadable file, 1 unreadable folder"
        with pytest.raises(ValueError, match="cannot read .*locked.txt: Permission denied"):
            load_tokens([tmp_path / "locked.txt"])
    finally:
        (tmp_path / "closed").chmod(0o755)


@pytest.mark.timeout(60)
def test_a_binary_file_is_told_by_its_first_block_or_by_a_later_nul(tmp_path):
    (tmp_path / "a.txt").write_bytes(b"text\n")
    with (tmp_path / "huge.img").open("wb") as file:  # sparse: reading it whole would not end
        file.truncate(2**40)
    (tmp_path / "late.bin").write_bytes(b"x" * 200_000 + b"\0")
    done = prepare([tmp_path], tmp_path / "t.out")
    assert done.files == 1 and str(done.skipped) == "2 binary files"
    with pytest.raises(ValueError, match="late.bin is not a text file"):
        load_tokens([tmp_path / "late.bin"])


def test_the_trainer_checks_a_token_files_digest_as_data_info_does(tmp_path, capsys):
    path = token_file(tmp_path, random_bytes(50))
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 1
    path.write_bytes(bytes(raw))
    message = f"{path} is damaged: its tokens do not match the digest in its header"
    again = "prepare it again with `cutpipe data prepare`"
    for read in (load_tokens, check_data, check_token_file, read_tokens):
        with pytest.raises(ValueError, match=message):
            read(path)
    assert bytes(read_tokens(path, verify=False).values.tolist()) == bytes(raw[HEADER_SIZE:])
    code, _, err = run(capsys, "data", "info", str(path))
    assert code == 2 and err == f"cutpipe data: error: {message}; {again}\n"


def test_empty_data_is_one_line_naming_what_was_read(tmp_path):
    path = token_file(tmp_path, b"abc")
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 20, 0)
    (tmp_path / "none.bin").write_bytes(bytes(raw[:HEADER_SIZE]))
    with pytest.raises(ValueError, match="none.bin holds no tokens: prepare it again"):
        load_tokens(tmp_path / "none.bin")
    (tmp_path / "empty.txt").write_bytes(b"")
    for read in (load_tokens, check_data):
        with pytest.raises(ValueError, match=r"no text in .*empty.txt: 1 empty file; give text"):
            read([tmp_path / "empty.txt"])
    (tmp_path / "binaries").mkdir()
    for name in ("a.png", "b.so"):
        (tmp_path / "binaries" / name).write_bytes(b"\x7fELF\0")
    with pytest.raises(ValueError, match=r"no text in .*binaries: skipped 2 binary files; give"):
        check_data(tmp_path / "binaries")
    (tmp_path / "short.txt").write_bytes(b"12345")
    with pytest.raises(ValueError, match=r"short.txt holds 5 tokens, 0 windows of 9 tokens, "
                       "fewer than one window: use a shorter sequence"):  # fmt: skip
        check_data([tmp_path / "short.txt"], seq_len=8)
    with pytest.raises(ValueError, match=r"short.txt holds 5 tokens, 2 windows of 3 tokens, "
                       r"fewer than one global batch \(4 windows\)"):  # fmt: skip
        TokenLoader(load_tokens([tmp_path / "short.txt"]), 2, 2, seed=0, replicas=2)
    assert check_data([tmp_path / "short.txt"], seq_len=2, windows=2).tokens == 5
    with pytest.raises(ValueError, match="seq_len must be a whole number >= 1, got 0"):
        check_data([tmp_path / "short.txt"], seq_len=0)


def test_check_data_sums_up_what_load_tokens_reads(tmp_path):
    root = make_tree(tmp_path / "corpus")
    summary = check_data([root])
    tokens = load_tokens([root])
    assert (summary.tokens, summary.digest) == (len(tokens), tokens.fingerprint)
    assert summary.files == 3 and str(summary.skipped) == "1 binary file"
    assert str(summary) == (
        f"data: 16 tokens of text from 3 files of {root}; skipped 1 binary file"
    )
    prepare([root], tmp_path / "t.bin")
    as_file = check_data(tmp_path / "t.bin", seq_len=4, windows=3)
    assert (as_file.kind, as_file.tokens, as_file.digest) == ("token file", 16, summary.digest)
    assert str(as_file) == f"data: {tmp_path / 't.bin'}, a token file of 16 tokens (digest checked)"
    with pytest.raises(ValueError, match="give it alone"):
        check_data([tmp_path / "t.bin", root])
    with pytest.raises(ValueError, match="drop the size cap"):
        check_data([tmp_path / "t.bin"], max_bytes=4)
    with pytest.raises(ValueError, match="no such file or folder"):
        check_data([tmp_path / "missing"])


# -- the unigram entropy -------------------------------------------------------------------------


def test_the_entropy_of_known_distributions():
    assert unigram_entropy(bytes(range(256)) * 3) == pytest.approx(math.log(256))
    assert unigram_entropy(b"aaaa") == 0.0
    assert unigram_entropy(b"abab") == pytest.approx(math.log(2))
    assert nats_to_bits(unigram_entropy(b"aabc")) == pytest.approx(1.5)
    assert unigram_entropy(torch.tensor([[0, 1000], [0, 1000]])) == pytest.approx(math.log(2))
    assert unigram_entropy(Tokens.from_bytes(b"abab")) == pytest.approx(math.log(2))
    with pytest.raises(ValueError, match="no tokens"):
        unigram_entropy(b"")
    with pytest.raises(ValueError, match="integers"):
        unigram_entropy(torch.zeros(3))


# -- the loader ----------------------------------------------------------------------------------


DATA = random_bytes(4001, seed=1)  # 4000 targets: 500 windows of 8


def batches(loader: TokenLoader, count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [next(loader) for _ in range(count)]


def same(a: list, b: list) -> bool:
    return len(a) == len(b) and all(
        torch.equal(x, y) and torch.equal(s, t) for (x, s), (y, t) in zip(a, b, strict=True)
    )


def test_batches_are_windows_of_the_tokens_with_targets_shifted_by_one():
    loader = TokenLoader(Tokens.from_bytes(DATA), seq_len=8, batch_size=4, seed=0)
    assert loader.batches_per_epoch == 500 // 4
    inputs, targets = next(loader)
    assert inputs.shape == targets.shape == (4, 8)
    assert inputs.dtype == targets.dtype == torch.long
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    for row, last in zip(inputs.tolist(), targets[:, -1].tolist(), strict=True):
        start = DATA.find(bytes([*row, last]))
        assert start >= 0 and start % 8 == 0


def test_one_epoch_visits_distinct_windows_in_a_seeded_order():
    tokens = Tokens.from_bytes(DATA)
    first = batches(TokenLoader(tokens, 8, 5, seed=3), 100)
    assert same(first, batches(TokenLoader(tokens, 8, 5, seed=3), 100))
    assert not same(first, batches(TokenLoader(tokens, 8, 5, seed=4), 100))
    rows = {tuple(row) for inputs, _ in first for row in inputs.tolist()}
    assert len(rows) == 500  # every window once
    later = batches(TokenLoader(tokens, 8, 5, seed=3), 200)[100:]
    assert not same(first, later)  # the next epoch has another order


@pytest.mark.parametrize("stop", [1, 123, 125, 126, 300])  # an epoch is 125 batches
def test_a_resumed_loader_sees_the_batches_of_the_uninterrupted_one(stop):
    tokens = Tokens.from_bytes(DATA)
    whole = batches(TokenLoader(tokens, 8, 4, seed=7), 310)
    before = TokenLoader(tokens, 8, 4, seed=7)
    assert same(batches(before, stop), whole[:stop])
    state = json.loads(json.dumps(before.state_dict()))  # plain values: any checkpoint holds it
    after = TokenLoader(tokens, 8, 4, seed=7)
    after.load_state_dict(state)
    assert same(batches(after, 310 - stop), whole[stop:])


def test_resuming_on_other_data_or_another_shape_is_refused():
    tokens = Tokens.from_bytes(DATA)
    state = TokenLoader(tokens, 8, 4, seed=7).state_dict()
    with pytest.raises(ValueError, match="same token file"):
        TokenLoader(Tokens.from_bytes(DATA[:-1] + b"!"), 8, 4, seed=7).load_state_dict(state)
    for changed in ({"seed": 8}, {"batch_size": 5}, {"seq_len": 9}):
        options = {"seq_len": 8, "batch_size": 4, "seed": 7} | changed
        with pytest.raises(ValueError, match=f"resume with the same {next(iter(changed))}"):
            TokenLoader(tokens, **options).load_state_dict(state)
    with pytest.raises(ValueError, match="damaged"):
        TokenLoader(tokens, 8, 4, seed=7).load_state_dict(state | {"index": 125})
    with pytest.raises(ValueError, match="lacks .*epoch"):
        TokenLoader(tokens, 8, 4, seed=7).load_state_dict({"index": 0})


def test_replicas_take_disjoint_slices_that_make_the_global_batch():
    tokens = Tokens.from_bytes(DATA)
    replicas = [TokenLoader(tokens, 8, 3, seed=5, rank=r, replicas=4) for r in range(4)]
    whole = TokenLoader(tokens, 8, 12, seed=5)
    for _ in range(45):  # past the end of the first epoch (41 batches)
        parts = [next(loader) for loader in replicas]
        inputs, targets = next(whole)
        assert torch.equal(torch.cat([p[0] for p in parts]), inputs)
        assert torch.equal(torch.cat([p[1] for p in parts]), targets)
        assert len({tuple(row) for row in inputs.tolist()}) == 12


def test_the_loader_refuses_what_it_cannot_batch():
    tokens = Tokens.from_bytes(DATA)
    with pytest.raises(ValueError, match="fewer than one global batch"):
        TokenLoader(tokens, 1001, 4, seed=0)
    with pytest.raises(ValueError, match="rank must be in 0..1"):
        TokenLoader(tokens, 8, 4, seed=0, rank=2, replicas=2)
    with pytest.raises(ValueError, match="seq_len must be a whole number"):
        TokenLoader(tokens, 0, 4, seed=0)
    with pytest.raises(ValueError, match="1-D uint8"):
        TokenLoader(torch.zeros(100, dtype=torch.long), 8, 4, seed=0)


def test_the_held_out_split_is_the_last_share_with_its_own_fingerprint():
    tokens = Tokens.from_bytes(DATA)
    train, held = tokens.split(0.1)
    assert (len(train), len(held)) == (3601, 400)
    assert bytes(held.values.tolist()) == DATA[-400:]
    assert len({tokens.fingerprint, train.fingerprint, held.fingerprint}) == 3
    assert train.fingerprint == tokens.split(0.1)[0].fingerprint != tokens.split(0.2)[0].fingerprint
    for share in (0.0, 1.0, 1e-9):
        with pytest.raises(ValueError, match="held-out share|leaves one part empty"):
            tokens.split(share)


# -- the command ---------------------------------------------------------------------------------


def test_prepare_and_info_on_the_command_line(capsys, tmp_path):
    make_tree(tmp_path / "corpus")
    out_file = tmp_path / "t.bin"
    code, out, _ = run(capsys, "data", "prepare", str(tmp_path / "corpus"), "-o", str(out_file),
                       "--json")  # fmt: skip
    assert code == 0
    done = json.loads(out)
    assert done["tokens"] == 4 + 1 + 6 + 1 + 4 and done["files"] == 3 and done["vocab"] == 256
    code, out, _ = run(capsys, "data", "info", str(out_file), "--json")
    info = json.loads(out)
    assert code == 0 and info["digest"] == done["digest"] and info["tokens"] == done["tokens"]
    assert info["entropy_bits"] == pytest.approx(nats_to_bits(info["entropy_nats"]))
    code, out, _ = run(capsys, "data", "info", str(out_file))
    assert code == 0 and "bits/token" in out and "nats/token" in out and "(checked)" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [(["prepare", "{tmp}/missing", "-o", "{tmp}/t.bin"], "missing: no such file or folder"),
     (["prepare", "{tmp}/void", "-o", "{tmp}/t.bin"], "no text in"),
     (["prepare", "{tmp}/void/x.bin", "-o", "{tmp}/t.bin"], "not a text file"),
     (["prepare", "{tmp}/void", "-o", "{tmp}/nodir/t.bin"], "does not exist"),
     (["prepare", "-o", "{tmp}/t.bin", "--max-mb", "0"], "--max-mb"),
     (["info", "{tmp}/void/x.bin"], "not a cutpipe token file"),
     (["info", "{tmp}/none.bin"], "does not exist")],
)  # fmt: skip
def test_command_errors_are_one_line_that_says_what_to_change(capsys, tmp_path, args, message):
    (tmp_path / "void").mkdir()
    binary = tmp_path / "x.bin"
    binary.write_bytes(b"\0\1\2")
    binary.replace(tmp_path / "void" / "x.bin")
    code, out, err = run(capsys, "data", *(a.format(tmp=tmp_path) for a in args))
    assert code == 2 and out == "" and err.count("\n") == 1 and message in err
    assert not (tmp_path / "t.bin").exists()


NO_TORCH = "import sys; sys.modules['torch'] = None\nfrom cutpipe.cli.main import main\nsys.exit(main(sys.argv[1:]))"  # fmt: skip


def test_prepare_needs_no_torch_and_info_says_how_to_get_it(tmp_path):
    (tmp_path / "a.txt").write_text("text\n")
    command = [sys.executable, "-c", NO_TORCH, "data"]
    done = subprocess.run([*command, "prepare", "a.txt", "-o", "t.bin"], capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0 and "wrote t.bin: 5 tokens" in done.stdout, done.stderr
    info = subprocess.run([*command, "info", "t.bin"], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert info.returncode == 2 and "needs PyTorch" in info.stderr
    loads = "import sys, cutpipe.data, cutpipe.cli.data; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", loads], check=True, timeout=120)
    checks = (
        "import sys; sys.modules['torch'] = None\nfrom cutpipe.data import check_data\n"
        "print(check_data('t.bin', seq_len=2)); print(check_data(['a.txt']))"
    )
    done = subprocess.run([sys.executable, "-c", checks], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        "data: t.bin, a token file of 5 tokens (digest checked)",
        "data: 5 tokens of text from 1 file of a.txt",
    ]


def test_the_module_entry_point_runs_data_info(tmp_path):
    path = token_file(tmp_path, b"abab")
    done = subprocess.run([sys.executable, "-m", "cutpipe.cli.main", "data", "info", str(path)],
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1.0000 bits/token" in done.stdout and "0.6931 nats/token" in done.stdout
