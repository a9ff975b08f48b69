"""``cutpipe generate``: greedy decoding token for token as ``transformers``' own ``generate``
on a Hugging Face folder, and text from a training checkpoint with no model file (its run
record says what was trained)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cutpipe.cli.main import main
from cutpipe.models.generate import Sampling, generate
from cutpipe.train.trained import byte_codec, from_checkpoint, from_hf_folder

transformers = pytest.importorskip("transformers")

TINY = Path(__file__).parents[1] / "examples" / "models" / "tiny-dense.yaml"
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def test_greedy_tokens_equal_transformers_generate(tmp_path):
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(config).eval()
    theirs.save_pretrained(tmp_path / "hf")
    prompt = [5, 17, 99, 3, 250, 8]
    with torch.no_grad():
        expected = theirs.generate(
            torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None,
            pad_token_id=0,
        )[0, len(prompt) :].tolist()  # fmt: skip
    trained = from_hf_folder(tmp_path / "hf")
    got = generate(trained.model, prompt, 12, trained.spec.seq_len, Sampling(temperature=0))
    assert got == expected
    one = generate(trained.model, prompt, 12, trained.spec.seq_len, Sampling(top_k=1))
    assert one == expected  # only the likeliest token left to draw
    drawn = [generate(trained.model, prompt, 8, 64, Sampling(1.0, seed=s)) for s in (1, 1, 2)]
    assert drawn[0] == drawn[1] != drawn[2]


@pytest.mark.timeout(300)
def test_a_training_checkpoint_generates_without_a_model_file(tmp_path, capsys):
    command = [sys.executable, "-m", "cutpipe", "train", "--quiet", "--model", str(TINY),
               "-s", "dualpipev", "--nproc", "2", "--steps", "2", "--global-batch", "8",
               "--checkpoint-dir", str(tmp_path / "ckpt")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=280, env=ENV)
    assert done.returncode == 0, done.stderr[-3000:]
    trained = from_checkpoint(tmp_path / "ckpt")
    assert trained.spec.layers == 8 and trained.spec.vocab == 256
    encode, decode = byte_codec().encode, byte_codec().decode
    expected = generate(trained.model, encode("def f("), 10, trained.spec.seq_len, Sampling(0))
    code = main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def f(",
                 "--max-new-tokens", "10", "--temperature", "0"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0 and out == "def f(" + decode(expected) + "\n"
    # a model trained on bytes takes no tokenizer
    tokenizers = pytest.importorskip("tokenizers")
    vocabulary = {"[UNK]": 0, "</s>": 1, "def": 2}
    words = tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]")
    tokenizers.Tokenizer(words).save(str(tmp_path / "tokenizer.json"))
    code = main(["generate", "--checkpoint", str(tmp_path / "ckpt"), "--prompt", "def",
                 "--tokenizer", str(tmp_path / "tokenizer.json")])  # fmt: skip
    err = capsys.readouterr().err
    assert code == 2 and "the checkpoint's run trained on bytes: drop --tokenizer" in err, err
    # the weights are the trained ones: the exported model continues the same way
    assert (
        main(["export", "--checkpoint", str(tmp_path / "ckpt"), "-o", str(tmp_path / "m.pt")]) == 0
    )
    capsys.readouterr()
    state = torch.load(tmp_path / "m.pt")
    assert all(torch.equal(state[k], v) for k, v in trained.model.state_dict().items())


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["--checkpoint", "nowhere", "--prompt", "x"], "--checkpoint nowhere: no such folder"),
        (["--checkpoint", ".", "--prompt", "x", "--temperature", "-1"], "--temperature"),
        (["--checkpoint", ".", "--prompt", "x", "--top-k", "0"], "--top-k"),
    ],
)
def test_bad_input_is_one_line(arguments, message, capsys):
    assert main(["generate", *arguments]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err
