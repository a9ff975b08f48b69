"""Output files: checked before the work, written whole or not at all, by every writer."""

from __future__ import annotations

import json
import os
import stat

import pytest

from cutpipe import generate, simulate
from cutpipe.files import check_output, replacing, write_text
from cutpipe.plan.costs.profile import Profile
from cutpipe.spec import ModelSpec
from cutpipe.viz import chrome_trace, html, png, scene


def test_check_output_names_what_is_wrong(tmp_path):
    assert check_output(tmp_path / "x.json", (".json",)) == tmp_path / "x.json"
    with pytest.raises(ValueError, match="the folder .*nodir does not exist"):
        check_output(tmp_path / "nodir" / "x.json")
    with pytest.raises(ValueError, match="is a folder"):
        check_output(tmp_path)
    with pytest.raises(ValueError, match=r"ending '.pdf' .* use one of .png, .html"):
        check_output(tmp_path / "x.pdf", (".png", ".html"))
    with pytest.raises(ValueError, match="without an ending"):
        check_output(tmp_path / "x", (".png",))
    with pytest.raises(ValueError, match="empty"):
        check_output("")


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_check_output_refuses_a_read_only_folder(tmp_path):
    tmp_path.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(ValueError, match="not writable"):
            check_output(tmp_path / "x.json")
    finally:
        tmp_path.chmod(stat.S_IRWXU)


def test_a_failed_write_leaves_the_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "out.json"
    target.write_text("old")

    class DiskFull(OSError):
        pass

    with pytest.raises(DiskFull), replacing(target) as temporary:
        temporary.write_text("half of the new")
        raise DiskFull("no space left")
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]


def test_write_text_replaces_and_keeps_the_usual_permissions(tmp_path):
    target = tmp_path / "out.txt"
    write_text(target, "first")
    write_text(target, "second")
    assert target.read_text() == "second"
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(target.stat().st_mode) == 0o666 & ~umask
    assert [p.name for p in tmp_path.iterdir()] == ["out.txt"]


def test_every_writer_writes_atomically(tmp_path, monkeypatch):
    """Each writer goes through the temporary-then-rename path: a failing rename keeps the
    old file."""
    timeline = simulate(generate("1f1b", 2, 2))
    drawing = scene([timeline])
    model = ModelSpec(name="m", layers=2, hidden=8, heads=2, ffn=16, vocab=10, seq_len=4)
    profile = Profile(model, "cpu", "fp32", {}, 0.5)
    writers = {
        "t.json": lambda path: timeline.save(path),
        "p.png": lambda path: png.save(drawing, path),
        "p.svg": lambda path: png.save(drawing, path),
        "p.html": lambda path: html.save(drawing, path),
        "c.json": lambda path: chrome_trace.save(drawing, path),
        "profile.json": lambda path: profile.save(path),
    }

    def refuse(source, target):
        raise OSError(28, "No space left on device")

    for name, write in writers.items():
        target = tmp_path / name
        target.write_text("old")
        with monkeypatch.context() as patch:
            patch.setattr(os, "replace", refuse)
            with pytest.raises(OSError, match="No space left"):
                write(target)
        assert target.read_text() == "old", name
        write(target)
        assert target.stat().st_size > 3, name
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(writers)
    json.loads((tmp_path / "t.json").read_text())
