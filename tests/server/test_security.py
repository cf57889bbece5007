"""Security hygiene: no remote code, no hub lookups, no prompts in logs unless asked for."""

from __future__ import annotations

import ast
import logging
from pathlib import Path

import pytest

from tests.server.server_fakes import FakeEngine

REPO = Path(__file__).resolve().parents[2]
SKIP_DIRS = {".venv", ".git", "build", "node_modules", "__pycache__", ".pytest_cache"}
# The code `pagedserve serve` runs to find and load a model.
SERVING_LOADERS = [REPO / "engine" / "loader.py", *sorted((REPO / "server").glob("*.py"))]


def project_files(suffixes: tuple[str, ...]) -> list[Path]:
    files = []
    for path in REPO.rglob("*"):
        if path.suffix in suffixes and not SKIP_DIRS & set(path.relative_to(REPO).parts):
            files.append(path)
    return files


def test_no_trust_remote_code_anywhere() -> None:
    """No call passes ``trust_remote_code`` and no dict carries it (``**{...: True}``), in any
    Python file of the project; no config, script or doc sets it either."""
    offenders = []
    for path in project_files((".py",)):
        if path == Path(__file__).resolve():
            continue
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.keyword) and node.arg == "trust_remote_code":
                offenders.append(f"{path}:{node.value.lineno}")
            if isinstance(node, ast.Dict):
                for key in node.keys:
                    if isinstance(key, ast.Constant) and key.value == "trust_remote_code":
                        offenders.append(f"{path}:{key.lineno}")
    for path in project_files((".toml", ".yml", ".yaml", ".json", ".cfg", ".sh", ".md", ".txt")):
        text = path.read_text(errors="replace").lower()
        for needle in ("trust_remote_code=true", "trust-remote-code", "trust_remote_code: true"):
            if needle in text:
                offenders.append(f"{path}: {needle}")
    assert offenders == []


def test_every_from_pretrained_on_the_serving_path_is_local_only() -> None:
    found = 0
    for path in SERVING_LOADERS:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "from_pretrained":
                found += 1
                flags = {k.arg: k.value for k in node.keywords}
                local = flags.get("local_files_only")
                assert isinstance(local, ast.Constant) and local.value is True, (
                    f"{path}:{node.lineno} may reach the hub"
                )
    assert found >= 3  # the GGUF conversion (model, tokenizer) and the tokenizer load


def test_a_model_that_is_not_a_local_checkpoint_is_refused(tmp_path: Path) -> None:
    from engine.loader import resolve_model

    for spec in ("meta-llama/Llama-3.1-8B", str(tmp_path / "missing"), str(tmp_path)):
        with pytest.raises(FileNotFoundError, match="never downloads"):
            resolve_model(spec)
    (tmp_path / "weights.bin").write_bytes(b"\0")
    with pytest.raises(FileNotFoundError):
        resolve_model(str(tmp_path / "weights.bin"))


async def test_the_model_field_never_reaches_the_filesystem(serve, monkeypatch) -> None:
    """Clients name the served model; anything else is a 404, never a path to resolve."""

    def forbidden(spec: str) -> None:
        raise AssertionError(f"resolve_model({spec!r}) called for a request")

    monkeypatch.setattr("engine.loader.resolve_model", forbidden)
    s = await serve()
    for model in ("../../etc/passwd", "/root/.ssh/id_rsa", "meta-llama/Llama-3.1-8B"):
        r = await s.http.post("/v1/completions", json={"model": model, "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


SECRET = "my bank password is hunter2"


async def send_everything(s) -> None:  # noqa: ANN001
    """Requests that reach every logging site: success, stream, chat, 400, engine failure,
    deadline, disconnect-free overload."""
    C = "/v1/completions"
    await s.http.post(C, json={"prompt": SECRET, "max_tokens": 3})
    await s.http.post(C, json={"prompt": [SECRET, SECRET], "max_tokens": 2, "stream": True})
    await s.http.post(
        "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2},
    )
    await s.http.post(C, json={"prompt": SECRET, "max_tokens": 10**6})
    await s.http.post(C, json={"prompt": SECRET, "temperature": -1})
    await s.http.post(C, json={"prompt": SECRET, "bogus_field": SECRET})
    await s.http.post("/tokenize", json={"prompt": SECRET})
    s.engine.fail_next_step = RuntimeError("step failed")
    await s.http.post(C, json={"prompt": SECRET, "max_tokens": 3})


async def test_logs_carry_no_prompt_unless_log_prompts(serve, caplog) -> None:
    caplog.set_level(logging.DEBUG)
    s = await serve(FakeEngine())
    await send_everything(s)
    assert "cmpl-" in caplog.text  # requests are logged: ids and sizes
    assert "hunter2" not in caplog.text
    caplog.clear()
    s = await serve(FakeEngine(), log_prompts=True)
    await send_everything(s)
    assert f"prompts=['{SECRET}']" in caplog.text
