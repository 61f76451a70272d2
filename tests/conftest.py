"""Shared fixtures: where the golden vectors live, and tiny random checkpoints."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlt_serve.testing import write_random_checkpoint

REPO = Path(__file__).resolve().parent.parent

# Tiny models gain nothing from intra-op threads, and on a busy CI box their spin-waits make the
# suite many times slower; one thread is also how the golden vectors were generated.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    """$RLT_GOLDEN_DIR, else <repo>/../shared/golden (CI clones the repo beside shared/)."""
    env = os.environ.get("RLT_GOLDEN_DIR")
    path = Path(env) if env else REPO.parent / "shared" / "golden"
    if not (path / "ouro_s" / "golden.safetensors").is_file():
        pytest.fail(
            f"golden vectors not found at {path} ({'from RLT_GOLDEN_DIR' if env else 'default location'}); "
            "set RLT_GOLDEN_DIR to the directory holding ouro_s/, nanbeige_s/, ..."
        )
    return path


@pytest.fixture
def tmp_checkpoint(tmp_path: Path) -> Callable[..., str]:
    """Factory: tmp_checkpoint(family, **overrides) -> path of a fresh random checkpoint.

    Overrides go to write_random_checkpoint (seed, dtype, max_shard_bytes, config fields).
    """
    count = 0

    def make(family: str, **overrides) -> str:
        nonlocal count
        count += 1
        return write_random_checkpoint(str(tmp_path / f"{family}-{count}"), family, **overrides)

    return make
