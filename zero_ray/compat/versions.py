"""The version check both adapters make at import."""

from __future__ import annotations

import re

from zero_ray.errors import UnsupportedVersionError


def release(installed: str) -> tuple[int, int]:
    """``(major, minor)`` of a version string such as ``2.13.0+cpu`` or ``2.11.0a0+git1234``."""
    match = re.match(r"(\d+)\.(\d+)", installed)
    if match is None:
        raise UnsupportedVersionError(f"cannot read a version from {installed!r}", installed=installed)
    return int(match.group(1)), int(match.group(2))


def require(package: str, installed: str, *, lowest: tuple[int, int], below: tuple[int, int], fix: str) -> None:
    """Raise ``UnsupportedVersionError`` unless ``lowest <= installed < below`` (major, minor)."""
    supported = f">={lowest[0]}.{lowest[1]},<{below[0]}.{below[1]}"
    try:
        ok = lowest <= release(installed) < below
    except UnsupportedVersionError:
        ok = False
    if not ok:
        raise UnsupportedVersionError(
            f"zero_ray uses private APIs of {package} that it checked only against {package}{supported}, "
            f"but {package} {installed} is installed; {fix}",
            package=package, installed=installed, supported=supported)


def missing(package: str, installed: str, names: list[str], *, fix: str) -> None:
    """Raise ``UnsupportedVersionError`` naming private attributes the installed version lacks."""
    if names:
        raise UnsupportedVersionError(
            f"{package} {installed} lacks private APIs zero_ray relies on: {', '.join(names)}; {fix}",
            package=package, installed=installed)
