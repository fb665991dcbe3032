"""torch.compile per unit (regional compilation), applied to a rank's module.

``apply_compile`` replaces the ``forward`` of each chosen unit with ``torch.compile(forward)``
on the instance, as activation checkpointing does: no wrapper module is inserted, so parameter
names, layouts, checkpoints and exports are the same compiled or not. ``nn.Module.__call__``
runs the module's hooks around ``forward``, so stage 3's gather (before) and free (after), and
the hooks that mark a unit's backward, stay outside the compiled region and see real
parameters; the compiled graph is traced with the gathered ones.

Identical blocks share their compiled code: torch caches it by the function's code object and
its guards, which every instance of a block passes at the same input shapes. Compilation is
lazy, at a unit's first call; inductor's on-disk caches (``Compile.cache_dir``) turn another
process's compilation of the same graphs into reads.

A module the user compiled in ``model_fn`` is refused (``refuse_user_compile``): compiled whole,
its region would contain the units' hooks and trace stage 3's empty placeholders, and its names
gain ``_orig_mod.``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import torch
from torch import nn

from zero_ray.compat.torch_private import compiled_in_place, compiled_original
from zero_ray.config import Compile
from zero_ray.errors import ModelError

# Where inductor keeps its caches (its documented setting); read when it first compiles.
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


def refuse_user_compile(module: nn.Module) -> None:
    """Raise ModelError naming the first module of ``module`` that ``model_fn`` compiled."""
    for path, sub in module.named_modules():
        if compiled_original(sub) is not None or compiled_in_place(sub):
            where = f"module {path!r}" if path else "the whole model"
            raise ModelError(
                f"model_fn returned a model in which {where} is torch.compile'd. zero_ray compiles each block "
                "itself, outside the hooks that gather, free and reduce its parameters (a compiled region "
                "around them traces stage 3's empty placeholders, and its parameter names gain '_orig_mod.'): "
                "return the plain module and pass ZeroConfig(compile=True), or "
                "zr.Compile(mode=..., fullgraph=..., dynamic=...) for torch.compile's options")


def apply_compile(module: nn.Module, paths: Sequence[str], options: Compile) -> list[str]:
    """Compile the ``forward`` of each submodule at ``paths`` (in place); returns the paths."""
    if options.cache_dir is not None:
        os.makedirs(options.cache_dir, exist_ok=True)
        os.environ[CACHE_ENV] = options.cache_dir
    for path in paths:
        sub = module.get_submodule(path)
        sub.forward = torch.compile(sub.forward, **options.options())  # type: ignore[method-assign]
    return list(paths)
