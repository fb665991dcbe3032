"""`zero-ray estimate`: the paper's per-device model-state memory and communication, per stage,
with data parallelism alone or across model-parallel (tensor-parallel) groups.

Pure arithmetic from `zero_ray.core.memory_formulas`; it starts no Ray and touches no device.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass
from typing import Any, TextIO

from zero_ray.core.memory_formulas import (
    OFFLOAD_TIERS,
    OPTIMIZERS,
    STAGES,
    ParallelLayout,
    communication_elements,
    communication_volume_multiple,
    largest_trainable_params,
    model_state_bytes,
    optimizer_bytes_per_param,
    optimizer_state,
    topology_communication,
    tier_bytes,
    topology_state_bytes,
)
from zero_ray.core.topology import GRAD_COMM, WEIGHT_COMM
from zero_ray.errors import ConfigError

_GB = 1e9  # the paper's GB (Table 1 and 2 use 1e9 bytes)
_GIB = float(2**30)  # what nvidia-smi and torch.cuda report

# Element sizes per precision: fp16 working copies in mixed precision, fp32 otherwise.
_PRECISION_BYTES: dict[str, tuple[int, int]] = {"mixed": (2, 2), "fp32": (4, 4)}

@dataclass(frozen=True, kw_only=True)
class _Accounting:
    param_bytes: int
    grad_bytes: int
    optimizer_bytes: int
    description: str


def _param_count(text: str) -> int:
    """--params: a whole, positive number of parameters, written as 7.5e9 or 7500000000."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 7.5e9)") from None
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 1")
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of parameters")
    # Integers above 2**53 written as plain digits would lose precision through float.
    return int(text) if text.strip().lstrip("+").isdigit() else int(value)


def positive_int(text: str) -> int:
    """An argparse type: a positive integer (--world-size; other commands use it too)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value


def _fraction(text: str) -> float:
    """--trainable-fraction: a number in (0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number (write e.g. 0.01 for 1%)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be in (0, 1]: the share of parameters that train")
    return value


def _device_gb(text: str) -> float:
    """--device-memory-gb: a positive, finite number of GB (1e9 bytes)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def register(subparsers: Any) -> None:
    """Add the `estimate` subcommand to the `zero-ray` parser."""
    parser = subparsers.add_parser(
        "estimate",
        help="per-device model-state memory and communication for ZeRO stages 0-3",
        description="Per-device model-state memory (parameters, gradients, optimizer states) and "
                    "per-step communication for ZeRO stages 0-3, from the paper's formulas. "
                    "Activations and buffers are not included.",
    )
    parser.add_argument("--params", type=_param_count, required=True, metavar="PSI",
                        help="number of model parameters, e.g. 7.5e9")
    sizes = parser.add_mutually_exclusive_group(required=True)
    sizes.add_argument("--world-size", type=positive_int, nargs="+", metavar="N",
                       help="owners (devices); one block is printed per value. With --tensor-parallel N_m they "
                            "form N / N_m data-parallel ranks of N_m model-parallel owners (without it, N_d = N)")
    sizes.add_argument("--data-parallel", type=positive_int, nargs="+", metavar="N_d",
                       help="instead of --world-size: data-parallel degree(s), each block then has N_d x N_m "
                            "owners (the paper's Table 2 keeps N_d = 64 and grows N_m)")
    parser.add_argument("--tensor-parallel", type=positive_int, nargs="+", default=None, metavar="N_m",
                        help="model-parallel (tensor-parallel) degree(s): each rank holds 1/N_m of the parameters, "
                             "partitioned by ZeRO across its N_d data-parallel peers; one block per world size and "
                             "N_m, and with --device-memory-gb a table of the largest model per N_m (Table 2); "
                             "default: 1")
    parser.add_argument("--precision", choices=sorted(_PRECISION_BYTES), default="mixed",
                        help="mixed: fp16 params/grads + fp32 optimizer; fp32: everything fp32 "
                             "(default: %(default)s)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adamw", metavar="NAME",
                        help="the torch.optim optimizer whose state is counted, 4 B per fp32 state element "
                             "(+ 4 B fp32 master in mixed precision): adam/adamw/nadam/radam/adamax/adadelta 8, "
                             "*-amsgrad 12, sgd 4 (0 with --no-momentum), adagrad/asgd/muon/rmsprop 4, "
                             "rmsprop-centered/rmsprop-momentum/rprop 8, rmsprop-centered-momentum 12, "
                             "adafactor 0 per element plus its factored row and column vectors (stated "
                             "apart: 4 (R + C) B per R x C matrix, 4 B per element of 1-D parameters); "
                             f"one of {', '.join(sorted(OPTIMIZERS))} (default: %(default)s)")
    parser.add_argument("--no-momentum", dest="momentum", action="store_false",
                        help="SGD without momentum (no momentum buffer)")
    parser.add_argument("--trainable-fraction", type=_fraction, default=1.0, metavar="F",
                        help="share of the parameters that train (frozen ones, e.g. a LoRA base model, have "
                             "no gradients or optimizer state); default: %(default)s")
    parser.add_argument("--device-memory-gb", type=_device_gb, default=None, metavar="GB",
                        help="device memory in GB (1e9 bytes); also print the largest model whose "
                             "model states fit, per stage")
    topo = parser.add_argument_group(
        "multi-node topology", "shard groups (MiCS / HSDP), hpZ's secondary partition and quantized collectives "
        "(ZeRO++): memory per owner and bytes sent inside a node and across nodes, per stage")
    topo.add_argument("--node-size", type=positive_int, default=None, metavar="L",
                      help="owners per node (default: the --shard-group or --secondary size, else 8)")
    topo.add_argument("--shard-group", type=positive_int, default=None, metavar="G",
                      help="partition within groups of G owners and replicate across groups")
    topo.add_argument("--secondary", type=positive_int, default=None, metavar="S",
                      help="stage 3: keep a secondary partition over S owners after forward (hpZ)")
    topo.add_argument("--weight-comm", choices=WEIGHT_COMM, default="fp32",
                      help="dtype of stage 3's forward all-gather (int8: qwZ); default: %(default)s")
    topo.add_argument("--grad-comm", choices=GRAD_COMM, default="fp32",
                      help="dtype of the gradient reduction across nodes (int4: qgZ); default: %(default)s")
    offload = parser.add_argument_group(
        "offload", "ZeRO-Offload / ZeRO-Infinity: model state per device on the device, in host memory and on NVMe")
    offload.add_argument("--offload-optimizer", choices=OFFLOAD_TIERS, default=None,
                         help="where the optimizer state (K bytes per element) lives")
    offload.add_argument("--offload-params", choices=OFFLOAD_TIERS, default=None,
                         help="where the parameter partition lives (stage 3 only)")
    parser.set_defaults(func=run)


def _print_offload(out: TextIO, args: argparse.Namespace, *, layout: ParallelLayout, acct: _Accounting,
                   fraction: float) -> None:
    """Model state per device by tier, per stage (parameters offloaded at stage 3 only)."""
    trainable = min(args.params, max(0, round(fraction * args.params)))
    stages = [3] if args.offload_params else list(STAGES)
    print(f"Offload at {_degrees(layout)}: optimizer state on {args.offload_optimizer or 'the device'}, parameters on "
          f"{args.offload_params or 'the device'}"
          + (" (stage 3 only: below it every device holds every parameter)" if args.offload_params else "")
          + ("; gradients go with the parameters" if args.offload_params else "; gradients stay on the device")
          + ". GB per device", file=out)
    rows = [["stage", "device GB", "host GB", "NVMe GB"]]
    for stage in stages:
        state = model_state_bytes(stage=stage, num_params=args.params, world_size=layout.data_parallel,
                                  param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                                  optimizer_bytes=acct.optimizer_bytes, trainable_params=trainable,
                                  model_parallel=layout.model_parallel)
        tiers = tier_bytes(state, stage=stage, optimizer=args.offload_optimizer, params=args.offload_params)
        rows.append([f"{stage} {STAGES[stage].name}", f"{tiers.device / _GB:.2f}", f"{tiers.host / _GB:.2f}",
                     f"{tiers.nvme / _GB:.2f}"])
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for k, row in enumerate(rows):
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _topology_given(args: argparse.Namespace) -> bool:
    return (args.shard_group is not None or args.secondary is not None or args.node_size is not None
            or args.weight_comm != "fp32" or args.grad_comm != "fp32")


def _print_topology(out: TextIO, args: argparse.Namespace, *, world_size: int, acct: _Accounting,
                    fraction: float) -> None:
    """Memory per owner and bytes sent inside / across nodes, flat against the topology."""
    node = args.node_size or args.shard_group or args.secondary or 8
    if world_size % node:
        raise ConfigError(f"--node-size {node} does not divide --world-size {world_size}")
    trainable = min(args.params, max(0, round(fraction * args.params)))
    print(f"Topology at Nd = {world_size}, {node} owners per node ({world_size // node} nodes): shard group "
          f"{args.shard_group or world_size}, secondary {args.secondary or '-'}, weights {args.weight_comm}, "
          f"gradients {args.grad_comm}. Bytes each owner sends per step (ring collectives over node-major "
          "ranks; int8/int4 include a 4 B scale per 256 elements)", file=out)
    headers = ["stage", "GB/owner", "of which secondary", "inside node GB", "cross node GB", "flat cross GB",
               "cross vs flat"]
    rows = []
    for stage in STAGES:
        if stage != 3 and (args.secondary is not None or args.weight_comm != "fp32"):
            continue
        mem = topology_state_bytes(stage=stage, num_params=args.params, world_size=world_size,
                                   shard_group_size=args.shard_group, secondary_group_size=args.secondary,
                                   param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                                   optimizer_bytes=acct.optimizer_bytes, trainable_params=trainable)
        comm = topology_communication(stage=stage, num_params=args.params, world_size=world_size, node_size=node,
                                      shard_group_size=args.shard_group, secondary_group_size=args.secondary,
                                      param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                                      weight_comm=args.weight_comm, grad_comm=args.grad_comm)
        flat = topology_communication(stage=stage, num_params=args.params, world_size=world_size, node_size=node,
                                      param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes)
        ratio = f"{comm.cross / flat.cross:.3f}x" if flat.cross else "-"
        rows.append([f"{stage} {STAGES[stage].name}", f"{mem.total / _GB:.2f}", f"{mem.secondary / _GB:.2f}",
                     f"{comm.inside / _GB:.3f}", f"{comm.cross / _GB:.3f}", f"{flat.cross / _GB:.3f}", ratio])
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.rjust(w) if i else h.ljust(w) for i, (h, w) in enumerate(zip(headers, widths))), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print("  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(row, widths))), file=out)


def _accounting(*, optimizer: str, precision: str, momentum: bool) -> _Accounting:
    param_bytes, grad_bytes = _PRECISION_BYTES[precision]
    mixed = precision == "mixed"
    k = optimizer_bytes_per_param(optimizer, mixed_precision=mixed, momentum=momentum)
    spec = optimizer_state(optimizer)
    # What K is made of, in torch's state names (the paper asks every report to say which
    # accounting it uses).
    held = (["fp32 master"] if mixed else []) + list(spec.per_element(momentum=momentum))
    state = " + ".join(held) or "none"
    if not mixed and held:
        state += " (the parameter is the master copy)"
    kind = "fp16" if mixed else "fp32"
    description = (f"{precision} precision {optimizer} (torch.optim.{spec.torch_name}): {param_bytes} B {kind} "
                   f"params + {grad_bytes} B {kind} grads + K = {k} B optimizer state ({state}) "
                   f"= {param_bytes + grad_bytes + k} B per parameter")
    if spec.note:
        description += f". {spec.note}"
    return _Accounting(param_bytes=param_bytes, grad_bytes=grad_bytes, optimizer_bytes=k,
                       description=description)


def _human_count(value: float) -> str:
    """7.5e9 -> "7.50B": two decimals in the largest unit (K, M, B, T) the value reaches."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:.2f}{suffix}"
    return f"{value:.0f}"


def _volume(stage: int, partitions_params: bool, *, frozen: bool, model_parallel: int = 1) -> str:
    """The per-step volume in units of Psi; with frozen parameters only the trainable ones
    (Psi_t) are reduced and updated; with model parallelism ZeRO-DP moves one slice's (/Nm)."""
    multiple = communication_volume_multiple(stage)
    if not frozen:
        volume = f"{multiple} Psi"
    else:
        volume = f"{multiple - 1} Psi + Psi_t" if partitions_params else f"{multiple} Psi_t"
    if model_parallel == 1:
        return volume
    return f"{volume}/Nm" if not frozen or not partitions_params else f"({volume})/Nm"


def _degrees(layout: ParallelLayout) -> str:
    """The degrees a block names: "Nd = 64", or with model parallelism "Nd = 64 x Nm = 16"."""
    text = f"Nd = {layout.data_parallel}"
    return text if layout.model_parallel == 1 else f"{text} x Nm = {layout.model_parallel}"


def _print_block(out: TextIO, *, num_params: int, layout: ParallelLayout, acct: _Accounting,
                 device_gb: float | None, fraction: float = 1.0) -> None:
    trainable = min(num_params, max(0, round(fraction * num_params)))
    share = f", {trainable} trainable ({fraction:g})" if fraction < 1 else ""
    world_size, nm = layout.data_parallel, layout.model_parallel
    mp = ""
    if nm > 1:
        mp = (f" ({layout.world_size} owners: each model-parallel rank holds 1/{nm} of Psi, "
              f"{_human_count(-(-num_params // nm))}, partitioned across its {world_size} data-parallel peers)")
    print(f"Psi = {num_params} parameters ({_human_count(num_params)}){share}, {_degrees(layout)}{mp}", file=out)
    headers = ["stage", "partitioned", "GB/device", "GiB/device", "vs stage 0",
               "comm volume", "sent/device/step"]
    if device_gb is not None:
        headers.append(f"max Psi @ {device_gb:g} GB")

    baseline = model_state_bytes(stage=0, num_params=num_params, world_size=world_size,
                                 param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                                 optimizer_bytes=acct.optimizer_bytes, trainable_params=trainable,
                                 model_parallel=nm).total
    rows: list[list[str]] = []
    for stage, spec in STAGES.items():
        total = model_state_bytes(stage=stage, num_params=num_params, world_size=world_size,
                                  param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                                  optimizer_bytes=acct.optimizer_bytes, trainable_params=trainable,
                                  model_parallel=nm).total
        sent = communication_elements(stage=stage, num_params=num_params, world_size=world_size,
                                      trainable_params=trainable, model_parallel=nm)
        row = [
            f"{stage} {spec.name}",
            "+".join(spec.partitioned) or "nothing",
            f"{total / _GB:.2f}",
            f"{total / _GIB:.2f}",
            # total > 0: --params >= 1 and every accounting has at least 2 B of parameters.
            f"{baseline / total:.2f}x",
            _volume(stage, spec.partitions_params, frozen=fraction < 1, model_parallel=nm),
            f"{sent:.4g} ({sent / num_params:.3f} Psi)",
        ]
        if device_gb is not None:
            largest = largest_trainable_params(
                stage=stage, world_size=world_size, device_bytes=device_gb * _GB,
                param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes,
                optimizer_bytes=acct.optimizer_bytes, trainable_fraction=fraction, model_parallel=nm)
            row.append(_human_count(largest))
        rows.append(row)

    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    # Text columns left-aligned, numbers right-aligned so that decimals line up.
    left = {0, 1}

    def fmt(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    print(fmt(headers), file=out)
    print("  ".join("-" * w for w in widths), file=out)
    for row in rows:
        print(fmt(row), file=out)


def _print_largest(out: TextIO, layouts: list[ParallelLayout], *, acct: _Accounting, device_gb: float,
                   fraction: float) -> None:
    """The paper's Table 2: the largest model whose model states fit, per layout and stage."""
    print(f"Largest model whose model states fit {device_gb:g} GB per device, by model-parallel degree "
          "(the paper's Table 2: N_d x N_m owners, N_m times the data-parallel figure)", file=out)
    headers = ["Nm", "owners", "Nd", *(f"{n} {spec.name}" for n, spec in STAGES.items())]
    rows = [[str(layout.model_parallel), str(layout.world_size), str(layout.data_parallel),
             *(_human_count(largest_trainable_params(
                 stage=stage, world_size=layout.data_parallel, device_bytes=device_gb * _GB,
                 param_bytes=acct.param_bytes, grad_bytes=acct.grad_bytes, optimizer_bytes=acct.optimizer_bytes,
                 trainable_fraction=fraction, model_parallel=layout.model_parallel)) for stage in STAGES)]
            for layout in layouts]
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    for k, row in enumerate([headers, *rows]):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)), file=out)
        if k == 0:
            print("  ".join("-" * w for w in widths), file=out)


def _layouts(args: argparse.Namespace) -> list[ParallelLayout]:
    """One layout per world size (or data-parallel degree) and model-parallel degree, in that
    order; a world size that is not a multiple of N_m raises ConfigError naming both flags."""
    layouts = []
    for size in args.world_size or args.data_parallel:
        for nm in args.tensor_parallel or [1]:
            if args.data_parallel:
                layouts.append(ParallelLayout(data_parallel=size, model_parallel=nm))
            elif size % nm:
                raise ConfigError(f"--world-size {size} is not divisible by --tensor-parallel {nm}: the owners form "
                                  f"data-parallel ranks of {nm} model-parallel owners each; give a world size that "
                                  f"is a multiple of {nm}, or --data-parallel N_d for N_d x {nm} owners")
            else:
                layouts.append(ParallelLayout.of_world_size(size, nm))
    if _topology_given(args) and any(layout.model_parallel > 1 for layout in layouts):
        raise ConfigError("--tensor-parallel above 1 with the multi-node topology flags (--node-size, --shard-group, "
                          "--secondary, --weight-comm, --grad-comm) is not modelled: drop one or the other")
    return layouts


def run(args: argparse.Namespace) -> int:
    """Print one table per world size; returns the exit status (2 for an invalid combination)."""
    if not args.momentum and optimizer_state(args.optimizer).momentum_state is None:
        # Its state does not depend on a momentum flag (Adam keeps both moments whatever beta1
        # is); accepting the flag would silently print the same numbers and mislead.
        print(f"zero-ray estimate: error: --no-momentum applies only to --optimizer sgd, "
              f"not {args.optimizer!r} (its state does not change with momentum; RMSprop's momentum "
              "buffer is counted by the rmsprop-momentum names)", file=sys.stderr)
        return 2
    try:
        acct = _accounting(optimizer=args.optimizer, precision=args.precision,
                           momentum=args.momentum)
        layouts = _layouts(args)  # before anything is printed: a bad layout prints nothing but the error
        out = sys.stdout
        print(f"Model states per device (GB = 1e9 bytes, GiB = 2**30 bytes); "
              f"{acct.description}.", file=out)
        print("Communication: elements each device sends per step with ring collectives, "
              "(Nd-1)/Nd of the volume.", file=out)
        if any(layout.model_parallel > 1 for layout in layouts):
            print("Model parallelism: each of Nm ranks holds 1/Nm of Psi and ZeRO partitions it across Nd; the "
                  "communication is ZeRO-DP's alone, over that slice (2 Psi/Nm, 3 Psi/Nm). Model parallelism's own "
                  "all-reduces of activations are not counted: the paper gives no closed form for them (they grow "
                  "with batch x sequence x hidden, not with Psi).", file=out)
        for layout in layouts:
            print(file=out)
            _print_block(out, num_params=args.params, layout=layout, acct=acct,
                         device_gb=args.device_memory_gb, fraction=args.trainable_fraction)
            if _topology_given(args):
                print(file=out)
                _print_topology(out, args, world_size=layout.world_size, acct=acct,
                                fraction=args.trainable_fraction)
            if args.offload_optimizer or args.offload_params:
                print(file=out)
                _print_offload(out, args, layout=layout, acct=acct, fraction=args.trainable_fraction)
        if args.tensor_parallel is not None and args.device_memory_gb is not None:
            print(file=out)
            _print_largest(out, layouts, acct=acct, device_gb=args.device_memory_gb,
                           fraction=args.trainable_fraction)
    except ConfigError as exc:
        print(f"zero-ray estimate: error: {exc}", file=sys.stderr)
        return 2
    return 0
