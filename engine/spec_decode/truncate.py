"""A truncated draft model: the first layers of a checkpoint, sharing its weights file.

    python -m engine.spec_decode.truncate SRC_DIR DST_DIR --num-layers 4

writes ``DST_DIR`` with SRC's ``config.json`` (``num_hidden_layers`` lowered) and links to
its weight and tokenizer files. pagedserve's loader takes the tensors the smaller model
names and ignores the rest, so no weight is copied. Such a draft shares the target's
embedding, first layers and head: a cheap stand-in for a trained draft model that shows the
draft machinery (benchmarks/speculative.py uses one with the default model).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def write_truncated_checkpoint(src: Path, dst: Path, num_layers: int) -> Path:
    """Args:
        src: an HF checkpoint directory (config.json + safetensors).
        dst: the directory to write (created).
        num_layers: decoder layers to keep (the first ones).
    Returns:
        ``dst``.
    """
    config = json.loads((src / "config.json").read_text())
    if not 1 <= num_layers <= config["num_hidden_layers"]:
        raise ValueError(
            f"num_layers must be in [1, {config['num_hidden_layers']}], got {num_layers}"
        )
    config["num_hidden_layers"] = num_layers
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for path in src.iterdir():
        if path.name == "config.json" or path.is_dir():
            continue
        link = dst / path.name
        if not link.exists():
            link.symlink_to(path.resolve())
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src", type=Path)
    parser.add_argument("dst", type=Path)
    parser.add_argument("--num-layers", type=int, required=True)
    args = parser.parse_args()
    try:
        print(write_truncated_checkpoint(args.src, args.dst, args.num_layers))
    except (OSError, ValueError, KeyError) as exc:
        parser.error(str(exc))


if __name__ == "__main__":
    main()
