"""engine/loader.py: a GGUF conversion killed part-way leaves nothing behind after the next
start, while another live conversion's private directory is left alone.

The conversion runs in child processes with transformers' loaders replaced by stand-ins (the
real one takes tens of seconds): one that converts until it is killed, so the kill lands
inside the conversion for certain, and one that writes a small checkpoint at once.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from tests.child_env import with_repo_on_path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, sys, time
from pathlib import Path
import transformers
from engine import loader

mode, gguf = sys.argv[1], Path(sys.argv[2])

class Saved:
    def __init__(self, name):
        self.name = name
        self.config = type("Config", (), {})()
        self.hf_quantizer = None
    def save_pretrained(self, path):
        (Path(path) / self.name).write_text(json.dumps({"model_type": "llama"}))

def from_pretrained(*args, **kwargs):
    if mode == "hang":
        print("CONVERTING", flush=True)
        time.sleep(600)
    return Saved("config.json")

transformers.AutoModelForCausalLM.from_pretrained = from_pretrained
transformers.AutoTokenizer.from_pretrained = lambda *a, **k: Saved("tokenizer.json")
print(loader.convert_gguf(gguf), flush=True)
"""


def _env(cache: Path) -> dict[str, str]:
    return with_repo_on_path(PAGEDSERVE_CACHE=str(cache))


def _start_hanging(cache: Path, gguf: Path) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, "hang", str(gguf)],
        cwd=ROOT,
        env=_env(cache),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert child.stdout is not None
    line = child.stdout.readline()  # the conversion has started: its private dir exists
    assert line.strip() == "CONVERTING", line
    return child


def test_a_killed_conversion_is_cleaned_up_by_the_next_start(tmp_path):
    cache = tmp_path / "cache"
    gguf = tmp_path / "tiny.gguf"
    gguf.write_bytes(b"GGUF stand-in")
    models = cache / "models"

    killed = _start_hanging(cache, gguf)
    killed.send_signal(signal.SIGKILL)
    killed.wait(timeout=30)
    assert [d.name for d in models.glob(".convert-*")] != []
    # The next start (here a conversion that stays alive) removes the killed one's directory.
    live = _start_hanging(cache, gguf)
    try:
        left = list(models.glob(".convert-*"))
        assert len(left) == 1 and f"+{live.pid}+" in left[0].name, left
        # A start beside that live conversion finishes its own and leaves the other's alone.
        done = subprocess.run(
            [sys.executable, "-c", CHILD, "finish", str(gguf)],
            cwd=ROOT,
            env=_env(cache),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-3000:]
        target = Path(done.stdout.strip().splitlines()[-1])
        assert (target / "config.json").is_file() and (target / "tokenizer.json").is_file()
        assert list(models.glob(".convert-*")) == left
    finally:
        live.kill()
        live.wait(timeout=30)
    # Once the second one has died too, any start (the model is converted now) removes its
    # directory as well.
    again = subprocess.run(
        [sys.executable, "-c", CHILD, "finish", str(gguf)],
        cwd=ROOT,
        env=_env(cache),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert list(models.glob(".convert-*")) == []
