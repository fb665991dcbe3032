"""Offline checkpoint commands (no Ray, no running job):

    zero-ray checkpoint inspect DIR [--verify] [--json]
    zero-ray checkpoint reshard DIR OUT --world-size M [--keep K]
    zero-ray checkpoint consolidate DIR OUT.safetensors
    zero-ray checkpoint export DIR OUT_DIR [--max-shard-size 5GB] [--dtype bfloat16]

DIR is a checkpoint directory or a checkpoint root (its ``latest`` is used). DIR, OUT and OUT_DIR
are local paths or URLs (``s3://bucket/prefix``, ``gs://...``, ``file://...``); an object store's
endpoint and credentials come from the standard environment (AWS_ENDPOINT_URL,
AWS_ACCESS_KEY_ID, ...). Any failure prints one line on stderr and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from types import ModuleType
from typing import Any

from zero_ray.cli.estimate import positive_int
from zero_ray.cli.subcommand_groups import SubParsers, subcommand_group
from zero_ray.errors import ZeroRayError


def register(subparsers: SubParsers) -> None:
    """Add ``checkpoint inspect``, ``checkpoint reshard`` and ``checkpoint consolidate``."""
    group = subcommand_group(subparsers, "checkpoint", help="write, inspect and convert checkpoints")
    inspect = group.add_parser("inspect", help="show what a checkpoint holds; --verify checks every byte")
    inspect.add_argument("path", metavar="DIR",
                         help="a checkpoint directory or URL, or a root with a 'latest' pointer")
    inspect.add_argument("--verify", action="store_true",
                         help="read every file and check all block checksums and each file's sha256")
    inspect.add_argument("--json", action="store_true", help="print the description as JSON")
    inspect.set_defaults(func=_inspect, command_name="checkpoint inspect")

    resh = group.add_parser("reshard", help="rewrite a checkpoint for another world size (offline)")
    resh.add_argument("path", metavar="DIR", help="the checkpoint to read")
    resh.add_argument("out", metavar="OUT", help="the checkpoint root to commit the resharded checkpoint under")
    resh.add_argument("--world-size", type=positive_int, required=True, metavar="M", help="ranks of the new layout")
    resh.add_argument("--keep", type=positive_int, default=None, metavar="K",
                      help="keep only the newest K checkpoints under OUT (default: remove none)")
    resh.set_defaults(func=_reshard, command_name="checkpoint reshard")

    cons = group.add_parser("consolidate", help="write the full fp32 state dict as one safetensors file")
    cons.add_argument("path", metavar="DIR", help="the checkpoint to read")
    cons.add_argument("out", metavar="OUT.safetensors", help="the file to write")
    cons.set_defaults(func=_consolidate, command_name="checkpoint consolidate")

    export = group.add_parser("export", help="write the weights as save_pretrained does (Hugging Face layout)")
    export.add_argument("path", metavar="DIR", help="the checkpoint to read")
    export.add_argument("out", metavar="OUT_DIR", help="the directory to write model.safetensors (or shards) into")
    export.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                        help="shard above this size, e.g. 5GB, 500MB, 2GiB (default: %(default)s)")
    export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                        help="convert floating tensors (default: as saved, float32)")
    export.set_defaults(func=_export, command_name="checkpoint export")


def _run(args: argparse.Namespace, action: Callable[[ModuleType], str]) -> int:
    """Print what ``action`` returns, given ``zero_ray.checkpoint.tools``; domain and file-system
    errors become one line on stderr and exit status 1."""
    # Imported here, not above: it imports torch, which the other commands and --help do without.
    from zero_ray.checkpoint import tools

    try:
        output = action(tools)
    except (ZeroRayError, OSError) as err:
        print(f"zero-ray {args.command_name}: error: {err}", file=sys.stderr)
        return 1
    print(output)
    return 0


def format_inspection(info: dict[str, Any]) -> str:
    """The text ``zero-ray checkpoint inspect`` prints for ``inspect_checkpoint``'s result."""
    optimizers = ", ".join(f"{o['type'].rsplit('.', 1)[-1]} ({o['kind']}, {o['groups']} groups)"
                           for o in info["optimizers"])
    lines = [
        f"checkpoint      {info['path']}",
        f"format version  {info['format_version']}",
        f"step            {info['step']} ({info['samples_seen']} samples)",
        f"stage           {info['stage']}",
        f"world size      {info['world_size']}",
        f"compute dtype   {info['compute_dtype']}",
        f"training        {' '.join(f'{k}={v}' for k, v in sorted(info['training'].items())) or '- (format 2)'}",
        f"optimizers      {optimizers or '-'}",
        f"scheduler       {', '.join(t.rsplit('.', 1)[-1] for t in info['schedulers']) or '-'}",
        f"state           {', '.join(info['state']) or '-'}",
        f"loss scaler     {' '.join(f'{k}={v}' for k, v in sorted(info['loss_scaler'].items())) or '-'}",
        f"parameters      {info['params']} ({info['elements']:,} elements in {info['buckets']} buckets; "
        f"{info['trainable_elements']:,} trainable), {info['buffers']} buffers",
        f"files           {len(info['files'])} ({info['bytes']:,} bytes)",
    ]
    width = max(len(f["name"]) for f in info["files"]) if info["files"] else 0
    lines += [f"  {f['name']:<{width}}  {f['size']:>14,}  sha256 {f['sha256']}" for f in info["files"]]
    if info["verified"]:
        lines.append("verified        every block checksum and file sha256 match")
    return "\n".join(lines)


def _inspect(args: argparse.Namespace) -> int:
    def action(tools: ModuleType) -> str:
        info = tools.inspect_checkpoint(args.path, verify=args.verify)
        return json.dumps(info, indent=1, sort_keys=True) if args.json else format_inspection(info)

    return _run(args, action)


def _reshard(args: argparse.Namespace) -> int:
    def action(tools: ModuleType) -> str:
        path = tools.reshard(args.path, args.out, world_size=args.world_size, keep=args.keep)
        return f"resharded for {args.world_size} ranks: {path}"

    return _run(args, action)


def _consolidate(args: argparse.Namespace) -> int:
    return _run(args, lambda tools: f"full fp32 state dict written to {tools.consolidate(args.path, args.out)}")


def _export(args: argparse.Namespace) -> int:
    def action(tools: ModuleType) -> str:
        files = tools.export_pretrained(args.path, args.out, max_shard_size=args.max_shard_size, dtype=args.dtype)
        return (f"{len(files)} file(s) written to {args.out}; add the model's config.json there and "
                "from_pretrained() loads it")

    return _run(args, action)
