"""What the two tuning tables' variables share (kernels/_tuning_file.py):
``PAGEDSERVE_MATMUL_TUNING`` and ``PAGEDSERVE_ATTENTION_TUNING`` each name a JSON file, read
once per path; unset or empty is no table, and a file that cannot be read, is not JSON or is
not a table of its kind is a ValueError naming the variable and the file."""

from __future__ import annotations

import json

import pytest

from kernels import attention_tuning, matmul_tuning

KINDS = [
    pytest.param(matmul_tuning.MATMUL_TUNING_ENV, matmul_tuning.matmul_tuning_env,
                 matmul_tuning.load_tuning, "matmul", id="matmul"),
    pytest.param(attention_tuning.ATTENTION_TUNING_ENV, attention_tuning.attention_tuning_env,
                 attention_tuning.load_tuning, "decode attention", id="attention"),
]  # fmt: skip


@pytest.mark.parametrize(("env", "from_env", "load", "kind"), KINDS)
def test_a_variable_names_a_file_read_once(tmp_path, env, from_env, load, kind):
    assert from_env({}) is None and from_env({env: ""}) is None
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"format": 1, "device": "d", "entries": []}))
    table = from_env({env: str(good)})
    assert table is load(str(good)) is from_env({env: str(good)})  # read once
    assert len(table) == 0 and table.device == "d" and table.source == str(good)
    missing = tmp_path / "none.json"
    garbled = tmp_path / "garbled.json"
    garbled.write_text("{not json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"format": 2, "entries": []}))
    for path, says in ((missing, "No such file"), (garbled, "Expecting"),
                       (other, f"not a {kind} tuning table of format 1")):  # fmt: skip
        with pytest.raises(ValueError, match=f"^{env}={path}: .*{says}"):
            from_env({env: str(path)})
