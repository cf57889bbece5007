"""The sm_90 build list itself (tests/kernels/sm90_builds.py); the builds are compiled by
each kernel's ``test_compiles_for_sm90``."""

from __future__ import annotations

import json
from dataclasses import asdict

from kernels.paged_attention import DECODE_TUNING
from tests.kernels.sm90_builds import SM90_BUILDS, builds_of


def test_no_build_is_compiled_twice():
    names_of: dict[str, list[str]] = {}
    for name, build in SM90_BUILDS.items():
        names_of.setdefault(json.dumps(asdict(build), sort_keys=True), []).append(name)
    assert [names for names in names_of.values() if len(names) > 1] == []


def test_every_decode_tuning_row_is_built():
    """Each row's (warps, stages, tile), unsplit and split where the row splits."""
    built = {
        (b.options["num_warps"], b.options["num_stages"], b.constexprs["TILE_N"],
         b.constexprs["SPLIT"])
        for name in builds_of("paged_attention")
        if (b := SM90_BUILDS[name]).kernel == "_paged_attention_decode_kernel"
    }  # fmt: skip
    for row in DECODE_TUNING:
        launch = (row.num_warps, row.num_stages, row.tile_n)
        assert (*launch, False) in built, row
        if row.target_waves > 0:
            assert (*launch, True) in built, row
