"""Paths the tests share (importable from any test module)."""

from __future__ import annotations

import os

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARED_DIR = os.path.join(os.path.dirname(REPO_ROOT), "shared")
