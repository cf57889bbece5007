"""benchmarks/split_model.py: a file split here, staged after one transfer and joined after the
next, comes back byte for byte; a missing or altered part is one line and exit status 2."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from benchmarks.split_model import main


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(os.urandom(3 * 2**20 + 12345))
    return path


def split_args(model_file: Path, parts: Path) -> list[str]:
    return ["split", "--model", str(model_file), "--parts-dir", str(parts), "--first-part-mib", "2"]


def test_split_stage_join_round_trip(model_file, tmp_path, capsys):
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    assert main(split_args(model_file, parts)) == 0
    manifest = json.loads((parts / "2" / "manifest.json").read_text())
    assert [p["bytes"] for p in manifest["parts"]] == [2 * 2**20, 2**20 + 12345]
    # each call carries one folder: part 1 with call 1, part 2 with call 2
    assert sorted(f.name for f in (parts / "1").iterdir()) == ["manifest.json", "model.gguf.part1"]
    assert sorted(f.name for f in (parts / "2").iterdir()) == ["manifest.json", "model.gguf.part2"]
    capsys.readouterr()
    assert main(["stage", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 0
    assert main(["join", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 0
    joined = Path(capsys.readouterr().out.splitlines()[-1])
    assert joined == stage / "model.gguf"
    assert joined.read_bytes() == model_file.read_bytes()
    assert sorted(f.name for f in stage.iterdir()) == ["model.gguf"]  # part 1 removed
    # joining again on the same machine finds the file joined
    assert main(["join", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 0


def test_join_without_part_1_says_so(model_file, tmp_path, capsys):
    parts = tmp_path / "parts"
    assert main(split_args(model_file, parts)) == 0
    (parts / "1" / "model.gguf.part1").unlink()  # the second transfer replaced the tree
    capsys.readouterr()
    assert main(["join", "--parts-dir", str(parts), "--stage-dir", str(tmp_path / "s")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert "holds no part 1" in err


def test_an_altered_part_is_refused(model_file, tmp_path, capsys):
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    assert main(split_args(model_file, parts)) == 0
    assert main(["stage", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 0
    part2 = parts / "2" / "model.gguf.part2"
    data = bytearray(part2.read_bytes())
    data[100] ^= 1
    part2.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["join", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 2
    err = capsys.readouterr().err
    assert "part 2" in err and "is not the file split wrote (size or SHA-256)" in err
    assert not (stage / "model.gguf").exists()


def test_a_file_of_one_part_is_refused(tmp_path, capsys):
    small = tmp_path / "small.gguf"
    small.write_bytes(b"x" * 100)
    assert main(split_args(small, tmp_path / "parts")) == 2
    assert "one part: carry it as it is" in capsys.readouterr().err


def test_join_takes_part_1_from_the_repository_copy_when_not_staged(model_file, tmp_path, capsys):
    """A call that carried part 1 but did not stage it leaves it in the repository's copy,
    which the machine keeps (an ignored path) for the next call."""
    parts, stage = tmp_path / "parts", tmp_path / "stage"
    assert main(split_args(model_file, parts)) == 0
    capsys.readouterr()
    assert main(["join", "--parts-dir", str(parts), "--stage-dir", str(stage)]) == 0
    assert (stage / "model.gguf").read_bytes() == model_file.read_bytes()
    assert (parts / "1" / "model.gguf.part1").is_file()  # not the joiner's to remove
