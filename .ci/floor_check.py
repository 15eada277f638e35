"""Checks that the floor venv holds each direct dependency at the floor pyproject.toml declares.

Run with the floor venv's python after `uv pip install --resolution lowest-direct`: uv takes the
lowest version that resolves with the rest, which is above the declared floor when that floor has
no wheel here or clashes with another dependency. Then the declared range would hold versions no
test ran on, so the job fails and names the floor to raise.
"""

from __future__ import annotations

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version


def declared_floor(requirement: Requirement) -> Version:
    """The version of the requirement's one `>=` clause: every dependency here names its floor so."""
    floors = [Version(spec.version) for spec in requirement.specifier if spec.operator == ">="]
    if len(floors) != 1:
        raise SystemExit(f"floor: {requirement} must name its floor with one '>=' clause")
    return floors[0]


def main(pyproject: Path, extras: list[str]) -> int:
    project = tomllib.loads(pyproject.read_text())
    requirements = [Requirement(line) for line in project["build-system"]["requires"]]
    requirements += [Requirement(line) for line in project["project"]["dependencies"]]
    for extra in extras:
        requirements += [Requirement(line) for line in project["project"]["optional-dependencies"][extra]]
    wrong = []
    print(f"{'package':<24} {'floor':>10} {'installed':>14}")
    for requirement in requirements:
        if requirement.marker is not None and not requirement.marker.evaluate():
            continue
        floor = declared_floor(requirement)
        installed = metadata.version(requirement.name)
        # The public version: torch's wheels carry a local tag (2.4.0+cu121).
        status = "" if Version(Version(installed).public) == floor else "  <- not the floor"
        print(f"{canonicalize_name(requirement.name):<24} {floor!s:>10} {installed:>14}{status}")
        if status:
            wrong.append(
                f"{requirement.name}: declared >={floor}, the oldest that installs here is {installed}"
            )
    if wrong:
        print(
            "floor: these floors cannot be installed here together with the rest; raise them in "
            "pyproject.toml so that the declared range is the tested one:\n  " + "\n  ".join(wrong),
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2:]))
