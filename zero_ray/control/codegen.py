"""Regenerate the protobuf and gRPC stubs in ``zero_ray/control/_generated``.

Run from a source checkout::

    python -m zero_ray.control.codegen             # rewrite the committed stubs
    python -m zero_ray.control.codegen --out DIR   # write DIR/zero_ray/control/_generated/*
    python -m zero_ray.control.codegen --check     # exit 1 if the committed stubs are stale

How the generated imports resolve without editing generated code: protoc names
a dependency's Python module after the dependency's *import path* (the path
relative to its ``-I`` root), and has no option to add a package prefix. So the
``.proto`` files import each other as ``zero_ray/control/_generated/<name>.proto``
and protoc is given the virtual mapping
``-Izero_ray/control/_generated=<checkout>/protos/zero_ray/v1``: the sources stay
in ``protos/zero_ray/v1`` while protoc sees them at the package path, so it
emits ``from zero_ray.control._generated import common_pb2`` and writes every
file to ``<out>/zero_ray/control/_generated/``. The alternatives were worse:
putting the output directory on ``sys.path`` would make ``zero_ray.v1`` clash
with the real ``zero_ray`` package, and rewriting imports after generation is
editing generated code.

The plain records the handlers take and return (``zero_ray/core/records.py``: compute returns
them without importing the control plane) are written in the same run from the descriptors protoc emits (:mod:`zero_ray.control.record_gen`), so a message's
fields are declared in its .proto alone.

The output depends on the grpcio-tools version (it is stamped into the stubs),
which is why pyproject.toml pins it exactly in the ``test`` extra.
"""

from __future__ import annotations

import argparse
import filecmp
import importlib.resources
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from google.protobuf import descriptor_pb2

from zero_ray.control import record_gen
from zero_ray.errors import ConfigError, ZeroRayError

# The Python package the stubs live in, as a path; also the virtual -I root.
GENERATED_PACKAGE = "zero_ray/control/_generated"
PROTO_FILES: tuple[str, ...] = ("common.proto", "owner.proto", "coordinator.proto", "relay.proto")
# What protoc writes per proto file; anything else in the package is hand-written.
_GENERATED_SUFFIXES: tuple[str, ...] = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")

_PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding zero_ray/


def default_proto_dir() -> Path:
    """``protos/zero_ray/v1`` of the checkout this module was imported from."""
    return _PACKAGE_ROOT / "protos" / "zero_ray" / "v1"


def default_out_root() -> Path:
    """The checkout root, so that stubs land in the committed package directory."""
    return _PACKAGE_ROOT


def is_generated(path: Path) -> bool:
    """Whether ``path`` is a file codegen writes (as opposed to ``__init__.py``)."""
    return path.name.endswith(_GENERATED_SUFFIXES)


def generate(out_root: Path, proto_dir: Path | None = None) -> list[Path]:
    """Run protoc (from grpcio-tools) on the proto sources, writing the stubs to
    ``out_root/zero_ray/control/_generated`` and the records to ``out_root/zero_ray/core/records.py`` and
    ``relay_records.py``; returns the generated files, the stubs sorted and the records last.

    Stale stubs in the target directory (from a removed proto) are deleted first.
    """
    try:
        from grpc_tools import protoc  # a development dependency, not a runtime one
    except ImportError as err:
        raise ConfigError("grpcio-tools is not installed; pip install -e '.[test]'") from err

    proto_dir = (proto_dir or default_proto_dir()).resolve()
    sources = [proto_dir / name for name in PROTO_FILES]
    missing = [str(path) for path in sources if not path.is_file()]
    if missing:
        raise ConfigError(f"proto sources not found: {missing=}; run from a source checkout or pass --protos")

    target = out_root / GENERATED_PACKAGE
    target.mkdir(parents=True, exist_ok=True)
    for old in target.iterdir():
        if is_generated(old):
            old.unlink()

    well_known = importlib.resources.files("grpc_tools") / "_proto"  # google/protobuf/*.proto
    with tempfile.TemporaryDirectory(prefix="zero_ray_descriptors_") as tmp:
        descriptors = Path(tmp) / "descriptors.pb"
        args = [
            "grpc_tools.protoc",
            f"-I{GENERATED_PACKAGE}={proto_dir}",
            f"-I{well_known}",
            f"--python_out={out_root}",
            f"--pyi_out={out_root}",
            f"--grpc_python_out={out_root}",
            # The descriptors with their comments, for the records.
            f"--descriptor_set_out={descriptors}",
            "--include_source_info",
            *(str(path) for path in sources),
        ]
        status = protoc.main(args)
        if status != 0:
            raise ZeroRayError(f"protoc failed with exit status {status} (its messages are above); {args=}")
        files = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes())
    written = []
    for module, _ in record_gen.MODULES:
        records = out_root / module
        records.parent.mkdir(parents=True, exist_ok=True)
        records.write_text(record_gen.render(files, module), encoding="utf-8")
        written.append(records)
    return sorted(path for path in target.iterdir() if is_generated(path)) + written


def stale_files(committed_root: Path | None = None, proto_dir: Path | None = None) -> list[str]:
    """Names of stubs under ``committed_root`` that differ from, are missing from,
    or are absent in a fresh generation; empty when the committed stubs are current."""
    root = committed_root or default_out_root()
    committed = root / GENERATED_PACKAGE
    with tempfile.TemporaryDirectory(prefix="zero_ray_codegen_") as tmp:
        fresh = {str(path.relative_to(tmp)): path for path in generate(Path(tmp), proto_dir)}
        existing = {str(path.relative_to(root)): path for path in committed.iterdir() if is_generated(path)} \
            if committed.is_dir() else {}
        for module, _ in record_gen.MODULES:
            if (root / module).is_file():
                existing[module] = root / module
        names = sorted(fresh.keys() | existing.keys())
        return [
            name
            for name in names
            if name not in fresh or name not in existing or not filecmp.cmp(fresh[name], existing[name], shallow=False)
        ]


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m zero_ray.control.codegen",
                                     description="Regenerate the protobuf and gRPC stubs of zero_ray.control.")
    parser.add_argument("--out", type=Path, default=None,
                        help="root to write zero_ray/control/_generated/ under (default: this checkout)")
    parser.add_argument("--protos", type=Path, default=None, help="directory holding the .proto sources")
    parser.add_argument("--check", action="store_true", help="only report whether the committed stubs are stale")
    args = parser.parse_args(argv)
    try:
        if args.check:
            stale = stale_files(args.out, args.protos)
            if stale:
                print(f"stale generated stubs: {', '.join(stale)}; run python -m zero_ray.control.codegen",
                      file=sys.stderr)
                return 1
            return 0
        for path in generate(args.out or default_out_root(), args.protos):
            print(path)
        return 0
    except ZeroRayError as err:
        print(f"codegen: error: {err}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
