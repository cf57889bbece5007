"""``python -m tests.server.fault_server --fault-token-id ID [serve options]``: the production
server (``pagedserve serve``) with the test-only fault injector around its engine's runner.

Every request whose prompt holds token ``ID`` raises inside the engine step
(tests/engine/fault_runner.py), so chaos tests can engineer per-request failures in a real
server process. The server's own flags have no way to do this: fault injection never ships.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

import engine.llm_engine
from server.cli import main as pagedserve_main
from tests.engine.fault_runner import FaultInjectingRunner


def install(token_id: int) -> None:
    """Make every ``LLMEngine`` built from now on in this process wrap its runner."""
    base = engine.llm_engine.LLMEngine

    class FaultInjectedEngine(base):  # type: ignore[misc, valid-type]
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.runner = FaultInjectingRunner(self.runner, token_id)

    # ``pagedserve serve`` imports LLMEngine from its module when it starts serving.
    engine.llm_engine.LLMEngine = FaultInjectedEngine  # type: ignore[misc]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.server.fault_server")
    parser.add_argument(
        "--fault-token-id",
        type=int,
        required=True,
        help="requests whose prompt holds this token id fail in the engine step",
    )
    args, serve_argv = parser.parse_known_args(sys.argv[1:] if argv is None else argv)
    install(args.fault_token_id)
    return pagedserve_main(["serve", *serve_argv])


if __name__ == "__main__":
    sys.exit(main())
