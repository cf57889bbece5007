"""``python -m tests.server.held_conversion_server [serve options]``: the production server
(``pagedserve serve``) whose GGUF conversion, once it has made its private directory, holds
until the process is killed.

A tiny GGUF file converts in about a second, too short a window to SIGKILL a start inside
it for certain; with this entry point the kill always lands there (tests/server/
test_first_start.py). Everything before the conversion, and the conversion's scratch
directory, is the real server's.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import transformers

from server.cli import main as pagedserve_main

HELD = "the GGUF conversion is held until this process is killed"


def _held(*args: Any, **kwargs: Any) -> Any:
    # engine/loader.py calls this after make_scratch_dir: the .convert-* directory exists.
    print(HELD, flush=True)
    while True:
        time.sleep(1)


def main(argv: Sequence[str] | None = None) -> int:
    # loader.convert_gguf imports AutoModelForCausalLM from transformers when it runs.
    transformers.AutoModelForCausalLM.from_pretrained = _held  # type: ignore[method-assign]
    return pagedserve_main(["serve", *(sys.argv[1:] if argv is None else argv)])


if __name__ == "__main__":
    sys.exit(main())
