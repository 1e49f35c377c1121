"""The mlx-lm and mlx-vlm this runs on are inside the range pyproject.toml declares, and that
range ends at the newest version the restated library bodies were checked against: a newer one
is a change someone must check (issue 36).
"""

from __future__ import annotations

import importlib.metadata
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]
CHECKED = ("mlx-lm", "mlx-vlm")


def declared() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = [Requirement(line) for line in project["dependencies"]]
    return {r.name: r for r in requirements if r.name in CHECKED}


@pytest.mark.parametrize("name", CHECKED)
def test_the_installed_version_is_in_the_tested_range(name):
    requirement = declared()[name]
    installed = importlib.metadata.version(name)
    assert requirement.specifier.contains(installed, prereleases=True), (
        f"{name} {installed} is outside pyproject.toml's {requirement}: check the bodies our "
        "routes restate against it (tests/models/test_patches.py, test_qkernels.py, "
        "test_cpu_math.py, test_decode_layer.py), then move the bound"
    )


@pytest.mark.parametrize("name", CHECKED)
def test_the_range_has_a_lower_and_an_inclusive_upper_bound(name):
    specs = {spec.operator: Version(spec.version) for spec in declared()[name].specifier}
    assert set(specs) == {">=", "<="}, f"{name}: {declared()[name]}"
    assert specs[">="] <= specs["<="]
