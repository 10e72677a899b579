"""Shared fixtures. GPU test modules skip with the reason when no GPU (or no build) exists."""

from __future__ import annotations

import pytest
import torch

import mmdeform_tma

@pytest.fixture
def generator():
    return torch.Generator().manual_seed(1234)


@pytest.fixture(autouse=True)
def _restore_global_state():
    strict = mmdeform_tma.strict_validation()
    deterministic = torch.are_deterministic_algorithms_enabled()
    yield
    mmdeform_tma.set_strict_validation(strict)
    torch.use_deterministic_algorithms(deterministic)
