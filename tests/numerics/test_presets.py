"""Random-weight presets: the same model code at any size, served without a checkpoint."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest
import torch

from draft_server.drafters.base import DraftItem, IngestItem
from draft_server.models.presets import PRESETS, random_drafter
from draft_server.models.tiny import K3_CONFIG, QWEN3_CONFIG
from protocol import GREEDY
from tests.conftest import ROOT


@pytest.mark.parametrize("cfg", [K3_CONFIG, QWEN3_CONFIG], ids=["k3", "qwen3"])
def test_random_drafter_drafts_deterministically(cfg):
    outs = []
    for _ in range(2):
        d = random_drafter(cfg, torch.device("cpu"), None, torch.float32)
        c = d.contract
        taps = np.random.default_rng(0).integers(0, 1 << 14, size=(6, c.tap_width), dtype=np.uint16)
        assert d.reserve(1, 0, 6)
        d.ingest([IngestItem(1, 0, 0, taps)])
        outs.append(d.draft([DraftItem(1, 0, 6, 5, c.block_size, GREEDY)])[0].tokens)
    assert outs[0] == outs[1] and len(outs[0]) == c.block_size
    assert all(0 <= t < c.vocab_size for t in outs[0])


def test_full_size_presets_have_real_dimensions():
    assert PRESETS["k3"]["hidden_size"] == 7168 and PRESETS["k3"]["vocab_size"] == 163840
    assert PRESETS["qwen3-8b"]["hidden_size"] == 4096


def test_unknown_preset_fails_before_binding():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "draft_server",
            "serve",
            "--model",
            "random:nope",
            "--device",
            "cpu",
            "--metrics-port",
            "-1",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert "unknown random preset 'nope'" in out.stderr
