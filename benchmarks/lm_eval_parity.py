"""lm-evaluation-harness through the server against the same harness on transformers.

    pip install "lm_eval[api]"          # not a dependency of the project
    python -m benchmarks.lm_eval_parity                   # the default model, float32, CPU
    python -m benchmarks.lm_eval_parity --base-url http://127.0.0.1:8000  # a running server

Evaluation harnesses score a model over HTTP with completions' ``echo`` and ``logprobs``:
lm-evaluation-harness's ``local-completions`` model sends each context + continuation as
token ids with ``echo: true, logprobs: 1, max_tokens: 1`` and reads the continuation's
logprobs and whether each of its tokens is the top-1 (server/prompt_logprobs.py). This runs
a small multiple-choice task (12 questions, 4 choices: 48 loglikelihoods) both ways, the
server (started here in float32 on the CPU unless ``--base-url`` names one) and the harness's
own ``hf`` model on the same checkpoint, and compares per choice: the loglikelihood, the
greedy flag and the accuracy. A server in float32 should agree to float32 rounding.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

QUESTIONS = [
    ("The capital of France is", [" Paris", " London", " Berlin", " Madrid"]),
    ("Water freezes at a temperature of zero degrees", [" Celsius", " Kelvin", " Fahrenheit", " Rankine"]),  # noqa: E501
    ("The largest planet in our solar system is", [" Jupiter", " Mars", " Venus", " Mercury"]),
    ("A week has seven", [" days", " hours", " years", " months"]),
    ("The opposite of hot is", [" cold", " warm", " red", " fast"]),
    ("Cats are animals that often chase", [" mice", " cars", " clouds", " books"]),
    ("The sun rises in the", [" east", " west", " north", " south"]),
    ("Two plus two equals", [" four", " five", " three", " six"]),
    ("The color of the sky on a clear day is", [" blue", " green", " purple", " black"]),
    ("Bees make", [" honey", " milk", " silk", " bread"]),
    ("The chemical symbol for water is", [" H2O", " CO2", " NaCl", " O2"]),
    ("Shakespeare wrote the play Romeo and", [" Juliet", " Hamlet", " Othello", " Macbeth"]),
]  # the first choice is the answer

TASK = """task: pagedserve_parity
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: 0
target_delimiter: ""
metric_list:
  - metric: acc
metadata:
  version: 1.0
"""


def write_task(directory: Path) -> None:
    data = directory / "data.jsonl"
    with data.open("w") as f:
        for question, choices in QUESTIONS:
            f.write(json.dumps({"question": question, "choices": choices}) + "\n")
    (directory / "pagedserve_parity.yaml").write_text(TASK.format(data=data))


@contextlib.contextmanager
def served(base_url: str | None, model: str, log: Path) -> Iterator[str]:
    """A server's base URL: ``base_url``, or one started here (float32, CPU) until exit."""
    if base_url is not None:
        yield base_url.rstrip("/")
        return
    from loadtest.launcher import ServerProcess, free_port

    port = free_port()
    argv = [sys.executable, "-m", "server", "--model", model, "--port", str(port),
            "--device", "cpu", "--dtype", "float32", "--stats-log-interval", "0"]  # fmt: skip
    with ServerProcess(argv, port, log) as process:
        process.wait_healthy(600)
        yield process.base_url


def samples(results: dict[str, Any]) -> dict[int, list[tuple[float, bool]]]:
    """doc id -> per choice (loglikelihood, greedy)."""
    return {
        s["doc_id"]: [(float(r[0][0]), bool(r[0][1])) for r in s["resps"]]
        for s in results["samples"]["pagedserve_parity"]
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="default", help="what the server serves (default model)")
    ap.add_argument("--base-url", default=None, help="a running server (else one is started)")
    ap.add_argument("--served-name", default=None, help="its model name (default: asked)")
    args = ap.parse_args(argv)
    try:
        import lm_eval
        from lm_eval.tasks import TaskManager
    except ImportError:
        print('lm-evaluation-harness is not installed: pip install "lm_eval[api]"')
        return 2
    import httpx

    from engine.loader import resolve_model

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the task's data is a local file
    checkpoint = str(resolve_model(args.model).path)
    with tempfile.TemporaryDirectory() as tmp:
        write_task(Path(tmp))
        tasks = TaskManager(include_path=tmp)
        with served(args.base_url, args.model, Path(tmp) / "server.log") as url:
            name = args.served_name or httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
            model_args = (f"model={name},base_url={url}/v1/completions,tokenizer={checkpoint},"
                          "tokenized_requests=True,num_concurrent=4,max_retries=1")  # fmt: skip
            server = lm_eval.simple_evaluate(
                model="local-completions", model_args=model_args,
                tasks=["pagedserve_parity"], task_manager=tasks, log_samples=True,
            )  # fmt: skip
        reference = lm_eval.simple_evaluate(
            model="hf", model_args=f"pretrained={checkpoint},dtype=float32", device="cpu",
            tasks=["pagedserve_parity"], task_manager=tasks, log_samples=True,
        )  # fmt: skip
    assert server is not None and reference is not None
    got, want = samples(server), samples(reference)
    diffs = [abs(a[0] - b[0]) for d in want for a, b in zip(got[d], want[d], strict=True)]
    flags = sum(a[1] == b[1] for d in want for a, b in zip(got[d], want[d], strict=True))
    acc = [r["results"]["pagedserve_parity"]["acc,none"] for r in (server, reference)]
    print(f"{len(want)} questions, {len(diffs)} loglikelihoods (pagedserve vs transformers)")
    print(f"max |loglikelihood difference|  {max(diffs):.3g}")
    print(f"mean |loglikelihood difference| {sum(diffs) / len(diffs):.3g}")
    print(f"greedy flags equal              {flags} / {len(diffs)}")
    print(f"accuracy                        {acc[0]:.4f} / {acc[1]:.4f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
