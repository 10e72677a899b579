"""tools/sanitize_cases.py on the CPU: its case groups and their selection (the calls need a GPU)."""

import inspect
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
import sanitize_cases  # noqa: E402


def test_every_config_family_of_the_tool_is_a_group():
    families = {name for name, fn in inspect.getmembers(sanitize_cases, inspect.isfunction) if name.endswith("_variants")}
    assert {fn.__name__ for _, fn in sanitize_cases.VARIANT_GROUPS.values()} == families


def test_every_group_runs_by_default():
    args = sanitize_cases.parse_args([])
    assert args.groups == list(sanitize_cases.GROUPS) and args.backends == ["cuda", "tma_ws"]


def test_a_run_narrows_to_one_family():
    args = sanitize_cases.parse_args(["--backends", "tma_ws", "--groups", "region"])
    assert args.groups == ["region"] and args.backends == ["tma_ws"]


def test_an_unknown_group_is_refused(capsys):
    with pytest.raises(SystemExit):
        sanitize_cases.parse_args(["--groups", "regions"])
    assert "invalid choice" in capsys.readouterr().err


def test_main_calls_only_the_chosen_groups(monkeypatch):
    called = []
    monkeypatch.setattr(sanitize_cases, "backend_calls", lambda backends: called.append(("ops", tuple(backends))))
    monkeypatch.setattr(sanitize_cases, "VARIANT_GROUPS", {
        group: (dtypes, lambda dtype, group=group: called.append((group, dtype)))
        for group, (dtypes, _) in sanitize_cases.VARIANT_GROUPS.items()})
    assert sanitize_cases.main(["--backends", "tma_ws", "--groups", "region"]) == 0
    assert [c[0] for c in called] == ["region", "region"]  # fp16 and bf16
    called.clear()
    sanitize_cases.main(["--backends", "cuda"])
    assert called == [("ops", ("cuda",))]  # the config families are tma_ws's
