"""What every source shares: how an owner reads its blocks (checked alike), and the layout's
view of those settings."""

from __future__ import annotations

from typing import Any

from zero_ray.errors import ConfigError


def check_read_options(source: Any, **integers: Any) -> None:
    """Check a source's ``window``, ``prefetch_steps``, ``cache_bytes`` and its own integer
    settings (``integers``: name -> value, each >= 1), naming the source and the value."""
    kind = type(source).__name__
    for name, value in {"window": source.window, **integers}.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ConfigError(f"{kind}({name}={value!r}) must be an integer >= 1")
    steps = source.prefetch_steps
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ConfigError(f"{kind}(prefetch_steps={steps!r}) must be an integer >= 0 (0: no prefetch)")
    size = source.cache_bytes
    if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
        raise ConfigError(f"{kind}(cache_bytes={size!r}) must be a positive number of bytes, or None for the default")


class FromSource:
    """A scanned layout's read settings, as its ``source`` has them."""

    source: Any

    @property
    def filesystem(self) -> Any:
        return getattr(self.source, "filesystem", None)

    @property
    def prefetch_steps(self) -> int:
        return self.source.prefetch_steps

    @property
    def window(self) -> int:
        return self.source.window
