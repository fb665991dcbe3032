"""The parser class of every ``zero-ray`` subcommand: one whose arguments may be added only when
it is the subcommand being parsed.

``zero-ray train``'s arguments come from ``zero_ray.demo``, which imports torch (about a second);
``zero-ray status`` (which operators and tests poll) and every ``--help`` do without it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence
from typing import Any


class CommandParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` that runs the functions given to :meth:`defer` (each adds arguments,
    defaults or a description to it) the first time it parses."""

    _deferred: list[Callable[[argparse.ArgumentParser], None]]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deferred = []

    def defer(self, add: Callable[[argparse.ArgumentParser], None]) -> None:
        """Call ``add(self)`` just before this parser first parses (argparse hands a subcommand's
        arguments to its parser's ``parse_known_args``)."""
        self._deferred.append(add)

    def parse_known_args(self, args: Sequence[str] | None = None,  # type: ignore[override]
                         namespace: argparse.Namespace | None = None) -> tuple[argparse.Namespace, list[str]]:
        while self._deferred:
            self._deferred.pop(0)(self)
        return super().parse_known_args(args, namespace)
