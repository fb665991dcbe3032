"""Subcommand groups shared between CLI modules.

``zero-ray checkpoint`` gathers actions from several modules (``now`` talks to a
running job; ``inspect``, ``reshard`` and ``consolidate`` work offline), but
argparse accepts a command name only once. Every module that contributes to a
group calls :func:`subcommand_group` with the same name and adds its actions to
what it returns; whichever module registers first creates the group.
"""

from __future__ import annotations

import argparse
import weakref

from zero_ray.errors import ConfigError

SubParsers = argparse._SubParsersAction  # argparse has no public name for it

# The group parser -> its actions; weak so that parsers built in tests can go away.
_GROUPS: weakref.WeakKeyDictionary[argparse.ArgumentParser, SubParsers] = weakref.WeakKeyDictionary()


def subcommand_group(subparsers: SubParsers, name: str, *, help: str) -> SubParsers:
    """The actions of the command group ``name`` under ``subparsers``, created on the
    first call (with ``help``) and shared by later ones."""
    existing = subparsers.choices.get(name)
    if existing is not None:
        try:
            return _GROUPS[existing]
        except KeyError:
            raise ConfigError(f"zero-ray {name!r} is registered as a plain command, not a group; "
                              "register it with subcommand_group()") from None
    parser = subparsers.add_parser(name, help=help, description=help)
    actions = parser.add_subparsers(dest=f"{name}_action", required=True, metavar="ACTION")
    _GROUPS[parser] = actions
    return actions
