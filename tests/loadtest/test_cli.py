"""`python -m loadtest run/report` through main(argv), against the fake server."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from loadtest.cli import main
from loadtest.cli_args import build_parser
from loadtest.plots import matplotlib_available
from tests.loadtest.fake_server import FakeServer

REPO = Path(__file__).resolve().parents[2]


def test_run_writes_json_and_prints_table(
    fake_server: Callable[..., FakeServer], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server(step_s=0.002)
    out = tmp_path / "results" / "x.json"
    argv = ["run", "--base-url", server.base_url, "--concurrency", "1,3", "--num-requests", "6",
            "--prompt-len-dist", "uniform:4:8", "--output-len-dist", "exponential:6:20",
            "--seed", "7", "--warmup-requests", "0", "--no-progress", "--slo-tpot", "none",
            "--out", str(out)]  # fmt: skip
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "concurrency=1" in printed and "concurrency=3" in printed and "out_tok/s" in printed
    result = json.loads(out.read_text())
    assert result["config"]["seed"] == 7 and result["config"]["slo"]["tpot_s"] is None
    assert [p["point"]["concurrency"] for p in result["points"]] == [1, 3]
    assert all(p["summary"]["num_completed"] == 6 for p in result["points"])
    if matplotlib_available():
        assert (tmp_path / "results" / "x-throughput_latency.png").exists()
    else:
        assert "matplotlib is not installed" in printed

    assert main(["report", str(out)]) == 0
    assert "concurrency=3" in capsys.readouterr().out


def test_request_rate_inf_and_extra_body(
    fake_server: Callable[..., FakeServer], capsys: pytest.CaptureFixture[str]
) -> None:
    server = fake_server()
    argv = ["run", "--base-url", server.base_url, "--request-rate", "inf", "--num-requests", "5",
            "--output-len-dist", "4", "--prompt-len-dist", "4", "--warmup-requests", "0",
            "--no-progress", "--no-ignore-eos", "--extra-body", '{"seed": 1}',
            "--model", "m"]  # fmt: skip
    assert main(argv) == 0
    assert "rate=inf" in capsys.readouterr().out
    assert all(b["seed"] == 1 and b["model"] == "m" and "ignore_eos" not in b
               for b in server.state.bodies)  # fmt: skip


def test_bad_input_and_unreachable_server(capsys: pytest.CaptureFixture[str]) -> None:
    base = ["run", "--base-url", "http://127.0.0.1:9", "--concurrency", "1", "--no-progress"]
    assert main([*base, "--output-len-dist", "zipf:2"]) == 2
    assert "bad length distribution" in capsys.readouterr().err
    assert main([*base, "--model", "m", "--no-tokenize", "--no-metrics"]) == 2
    assert "warm-up request failed" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", "--concurrency", "1", "--request-rate", "2"])  # mutually exclusive


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["run", "--concurrency", "x"], "positive integers such as 1,4,16, got 'x'"),
        (["run", "--concurrency", "0,4"], "got '0,4'"),
        (["run", "--request-rate", "fast"], "positive rates such as 0.5,1,inf, got 'fast'"),
        (["run", "--request-rate", "0"], "got '0'"),
        (["run", "--concurrency", "1", "--slo-ttft", "soon"], "seconds > 0 or none, got 'soon'"),
        (["run", "--concurrency", "1", "--extra-body", "{bad"], "not JSON"),
        (["run", "--concurrency", "1", "--extra-body", "[1]"], "expected a JSON object"),
        (["run", "--concurrency", "1", "--bogus"], "unrecognized arguments: --bogus"),
        (["run"], "one of the arguments --concurrency --request-rate --trace is required"),
        ([], "the following arguments are required: command"),
    ],
)
def test_a_command_line_mistake_is_one_line(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv, prog="pagedserve bench")
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and "--help" in err, err
    assert err.startswith("pagedserve bench"), err


def test_rates_and_slos_parse() -> None:
    args = build_parser().parse_args(["run", "--request-rate", "0.5,inf", "--slo-tpot", "off"])
    assert args.request_rate == (0.5, math.inf) and args.slo_tpot is None
    args = build_parser().parse_args(["run", "--concurrency", "1, 4", "--extra-body", '{"a": 1}'])
    assert args.concurrency == (1, 4) and args.extra_body == {"a": 1}


def test_module_entry_point() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "loadtest", "run", "--help"],
        cwd=REPO, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0 and "--request-rate" in proc.stdout


@pytest.mark.parametrize(
    ("content", "says"),
    [
        (b"\x89PNG\r\n", "is not a result file (not text"),  # a plot given by mistake
        (b"not json", "is not a result file (not JSON"),
        (b"[1, 2]", 'has "kind": "sweep" or "compare"'),
        (b"{}", 'has "kind": "sweep" or "compare"'),
        (b'{"kind": "sweep"}', "is not a whole sweep result (KeyError: 'points')"),
        (b'{"kind": "compare", "table": 1}', "is not a whole compare result"),
    ],
)
def test_report_of_a_file_that_is_no_result_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, says: str
) -> None:
    path = tmp_path / "x.json"
    path.write_bytes(content)
    assert main(["report", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err


def test_an_out_path_it_cannot_write_fails_before_the_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Checked first: no server listens on the base URL, and the error is the path's."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    for out, says in [(blocker / "x.json", "cannot create its folder"),
                      (tmp_path, "not a file this user can write")]:  # fmt: skip
        argv = ["run", "--base-url", "http://127.0.0.1:9", "--concurrency", "1",
                "--num-requests", "2", "--no-progress", "--out", str(out)]  # fmt: skip
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err and "connect" not in err, err


def test_a_server_that_wants_a_key_is_told_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class NeedsKey(BaseHTTPRequestHandler):
        def _refuse(self) -> None:
            body = b'{"error": {"message": "Missing or invalid API key"}}'
            self.send_response(401)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_POST = _refuse

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), NeedsKey)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        argv = ["run", "--base-url", url, "--concurrency", "1", "--num-requests", "2",
                "--no-progress"]  # fmt: skip
        assert main(argv) == 2
    finally:
        server.shutdown()
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert "answered HTTP 401 Unauthorized (it needs an API key: --api-key KEY)" in err, err
