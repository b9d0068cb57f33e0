"""``draft_tools.bench.markov_prune``: the bounds keep the tile of the true argmax, and tighter bounds keep fewer."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from draft_tools.bench.markov_prune import TILE, candidates, main


def test_candidates_keeps_every_tile_whose_bound_reaches_the_best_lower_bound() -> None:
    score = torch.full((4 * TILE,), -10.0)
    score[5] = 3.0  # tile 0: the best estimate, lower bound 2.0
    score[TILE + 7] = 1.5  # tile 1: upper bound 2.5 reaches 2.0
    score[2 * TILE + 1] = 0.9  # tile 2: upper bound 1.9 does not
    keep = candidates(score, torch.ones(4 * TILE))
    assert keep.tolist() == [True, True, False, False]


def test_tighter_bounds_keep_fewer_tiles_and_never_the_wrong_ones(tmp_path: Path) -> None:
    out = tmp_path / "prune.json"
    assert main(["--preset", "tiny", "--passes", "6", "--out", str(out)]) == 0  # asserts the argmax's tile is kept
    b = json.loads(out.read_text())["bounds"]
    assert 0 < b["int8"]["candidate_tile_fraction_mean"] <= b["int4"]["candidate_tile_fraction_mean"]
    assert b["int4"]["candidate_tile_fraction_mean"] < b["cs"]["candidate_tile_fraction_mean"] <= 1.0
