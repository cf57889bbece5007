"""benchmarks/speculative.py end to end on the tiny random Llama with the test tokenizer:
both parts (n-gram, truncated draft) run off and on in two engines, the "off" one built
without speculation, and bad flags are one line and exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import speculative
from tests.server.tiny_server import make_tiny_model_dir


def test_the_benchmark_compares_two_engines_on_every_part(tmp_path: Path) -> None:
    model = make_tiny_model_dir(tmp_path / "tiny", seed=1)
    out = tmp_path / "result.json"
    argv = ["--model", str(model), "--device", "cpu", "--dtype", "float32",
            "--num-kv-blocks", "128", "--c1-prompts", "1", "--grounded-tokens", "8",
            "--free-tokens", "8", "--wave-tokens", "8", "--passage-words", "12",
            "--wave-passage-words", "6",
            "--concurrency", "3", "--repeats", "1", "--draft-layers", "1", "--threads", "1",
            "--out", str(out)]  # fmt: skip
    assert speculative.main(argv) == 0
    result = json.loads(out.read_text())
    for part in ("ngram", "draft"):
        engines = result[part]
        assert engines["device"] == "cpu" and engines["dtype"] == "float32"
        # Both off on the CPU; on CUDA the "off" engine keeps its asynchronous steps.
        assert engines["async_scheduling_off"] is False
        assert engines["async_scheduling_on"] is False
    parts = ["ngram_grounded_c1", "ngram_free_c1", "ngram_wave_c3", "draft_grounded_c1",
             "draft_free_c1"]  # fmt: skip
    for part in parts:
        identical, total = map(int, result[part]["identical_outputs"].split("/"))
        assert identical == total > 0, (part, result[part])
    assert result["ngram_wave_c3"]["output_tokens"] == 3 * 8


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--model", "llama-3.2-1b", "--load-format", "dummy"], "add --skip-draft"),
        (["--concurrency", "16,x"], "comma-separated integers"),
        (["--dtype", "float64"], "invalid choice"),
        (["--device", "tpu"], "invalid choice"),
    ],
)
def test_bad_flags_are_one_line_and_exit_2(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exc:
        speculative.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
