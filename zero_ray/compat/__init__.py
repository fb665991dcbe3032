"""Adapters over the private APIs of zero_ray's dependencies: one module per dependency
(``ray_private``, ``torch_private``), the only code in the package that touches them.

Each adapter checks at import that the installed version is one it was written for and that
every private attribute it uses exists, raising ``UnsupportedVersionError`` otherwise: an
upgrade that renames one fails loudly at import, not later in the middle of a run. Each
function's docstring says why the private API is needed and whether a public one exists.
This package imports nothing of zero_ray but ``errors`` (tests/unit/test_layering.py), and
nothing outside it uses a private ray or torch attribute (tests/unit/test_private_apis.py).
"""
