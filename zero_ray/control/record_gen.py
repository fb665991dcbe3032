"""Write the plain records (``zero_ray/core/records.py``, and the relay tree's in
``zero_ray/core/relay_records.py``) from the .proto descriptors.

Each message a handler takes or returns has a frozen keyword-only dataclass whose fields are
the message's fields, by name and in declaration order, so that a field is declared once, in
the .proto: ``python -m zero_ray.control.codegen`` writes the record with the stubs, and
:mod:`zero_ray.control.conversion` converts between the two by walking the descriptor. Types:
a scalar is its Python type with proto3's zero default; ``repeated`` a tuple (default ``()``);
a map a ``Mapping`` (default ``{}``); a message field its record, required unless declared
``optional`` (then ``None`` when unset); an enum its number. A ``RequestHeader`` field is the
envelope the clients add, not a record field. Docstrings and field comments are the .proto's.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import descriptor_pb2

from zero_ray.errors import ConfigError

# Where the records are written, under the checkout root: in core/, below every package that uses
# them, so that compute returns them without importing the control plane (the wire stays here).
# The relay tree's records are a module of their own: one module of every record outgrew a file.
MODULE = "zero_ray/core/records.py"
RELAY_MODULE = "zero_ray/core/relay_records.py"
ENVELOPE = "zero_ray.v1.RequestHeader"
# (record name, message) for every message a handler takes or returns. Records that check
# their values subclass theirs in zero_ray/control/handlers.py under the same name.
RECORDS: tuple[tuple[str, str], ...] = (
    ("Piece", "zero_ray.v1.Piece"),
    ("LossTotals", "zero_ray.v1.LossTotals"),
    ("StepArgs", "zero_ray.v1.StepRequest"),
    ("StepResult", "zero_ray.v1.StepReply"),
    ("EvaluateArgs", "zero_ray.v1.EvaluateRequest"),
    ("EvaluateResult", "zero_ray.v1.EvaluateReply"),
    ("SaveResult", "zero_ray.v1.SaveReply"),
    ("LoadResult", "zero_ray.v1.LoadReply"),
    ("Heartbeat", "zero_ray.v1.Heartbeat"),
    ("OwnerStats", "zero_ray.v1.StatsReply"),
    ("ParamInfo", "zero_ray.v1.ParamInfo"),
    ("ModelLayout", "zero_ray.v1.ModelLayout"),
    ("SetupResult", "zero_ray.v1.SetupReply"),
    ("OwnerStatus", "zero_ray.v1.OwnerStatusReply"),
    ("RankStatus", "zero_ray.v1.RankStatus"),
    ("JobStatus", "zero_ray.v1.StatusReply"),
    ("CheckpointResult", "zero_ray.v1.CheckpointReply"),
    ("ResizeResult", "zero_ray.v1.ResizeReply"),
    ("MetricsEvent", "zero_ray.v1.MetricsEvent"),
    ("CollectiveEvent", "zero_ray.v1.CollectiveEvent"),
    ("Flight", "zero_ray.v1.FlightReply"),
    ("FailureDetailRecord", "zero_ray.v1.FailureDetail"),
)
# The relay tree's (relay.proto), written to RELAY_MODULE; they may name the records above.
RELAY_RECORDS: tuple[tuple[str, str], ...] = (
    ("RelayStepArgs", "zero_ray.v1.RelayStepRequest"),
    ("ExactSumValue", "zero_ray.v1.ExactSumValue"),
    ("SubtreeTotals", "zero_ray.v1.SubtreeTotals"),
    ("StepAgreed", "zero_ray.v1.StepAgreed"),
    ("RankSpan", "zero_ray.v1.RankSpan"),
    ("FailedRank", "zero_ray.v1.FailedRank"),
    ("SubtreeStep", "zero_ray.v1.RelayStepReply"),
    ("RelayChildSeat", "zero_ray.v1.RelayChildSeat"),
    ("HostedRelay", "zero_ray.v1.HostedRelay"),
    ("HostRelaysArgs", "zero_ray.v1.HostRelaysRequest"),
    ("HostRelaysResult", "zero_ray.v1.HostRelaysReply"),
    ("RelayEvaluateArgs", "zero_ray.v1.RelayEvaluateRequest"),
    ("SubtreeEvaluation", "zero_ray.v1.RelayEvaluateReply"),
    ("RelayCallArgs", "zero_ray.v1.RelayCallRequest"),
    ("RankReply", "zero_ray.v1.RankReply"),
    ("SubtreeReplies", "zero_ray.v1.RelayCallReply"),
)
# Each module written and the records it holds, in the order written (a later one imports from
# those before it).
MODULES: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ((MODULE, RECORDS), (RELAY_MODULE, RELAY_RECORDS))
ALL_RECORDS: tuple[tuple[str, str], ...] = RECORDS + RELAY_RECORDS

_F = descriptor_pb2.FieldDescriptorProto
_INT = ("int", "0")
_SCALARS: dict[int, tuple[str, str]] = {
    _F.TYPE_DOUBLE: ("float", "0.0"), _F.TYPE_FLOAT: ("float", "0.0"), _F.TYPE_BOOL: ("bool", "False"),
    _F.TYPE_STRING: ("str", '""'), _F.TYPE_BYTES: ("bytes", 'b""'), _F.TYPE_ENUM: _INT,
    **{t: _INT for t in (_F.TYPE_INT32, _F.TYPE_INT64, _F.TYPE_UINT32, _F.TYPE_UINT64, _F.TYPE_SINT32,
                         _F.TYPE_SINT64, _F.TYPE_FIXED32, _F.TYPE_FIXED64, _F.TYPE_SFIXED32, _F.TYPE_SFIXED64)},
}
# SourceCodeInfo paths: FileDescriptorProto.message_type = 4, DescriptorProto.field = 2.
_MESSAGE_TYPE, _FIELD = 4, 2


@dataclass(frozen=True, kw_only=True)
class _Message:
    proto: descriptor_pb2.DescriptorProto
    comment: str
    field_comments: tuple[str, ...]


def _comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {tuple(loc.path): loc.leading_comments for loc in file.source_code_info.location
            if loc.leading_comments}


def _index(files: descriptor_pb2.FileDescriptorSet) -> dict[str, _Message]:
    """Every message (map entries included) by full name, with its leading comments."""
    out: dict[str, _Message] = {}
    for file in files.file:
        comments = _comments(file)

        def add(message: descriptor_pb2.DescriptorProto, scope: str, path: tuple[int, ...] | None) -> None:
            name = f"{scope}.{message.name}"
            out[name] = _Message(proto=message, comment=comments.get(path, "") if path else "",
                                 field_comments=tuple(comments.get((*path, _FIELD, i), "") if path else ""
                                                      for i in range(len(message.field))))
            for nested in message.nested_type:
                add(nested, name, None)

        for i, message in enumerate(file.message_type):
            add(message, file.package, (_MESSAGE_TYPE, i))
    return out


def _optional(f: descriptor_pb2.FieldDescriptorProto) -> bool:
    return f.proto3_optional or f.HasField("oneof_index")


def _annotation(f: descriptor_pb2.FieldDescriptorProto, where: str, index: dict[str, _Message],
                record_of: dict[str, str]) -> tuple[str, str | None]:
    """The field's annotation and default (None: required)."""
    repeated = f.label == _F.LABEL_REPEATED
    if f.type == _F.TYPE_MESSAGE:
        target = f.type_name.lstrip(".")
        entry = index[target].proto
        if entry.options.map_entry:
            key, value = entry.field
            value_type = _annotation(value, where, index, record_of)[0]
            return f"Mapping[{_SCALARS[key.type][0]}, {value_type}]", "field(default_factory=dict)"
        if target not in record_of:
            raise ConfigError(f"{where} is a {target}, which has no record; add it to record_gen.RECORDS "
                              "(or RELAY_RECORDS)")
        name = record_of[target]
        return ((f"tuple[{name}, ...]", "()") if repeated else (f"{name} | None", "None") if _optional(f) else
                (name, None))
    if f.type not in _SCALARS:
        raise ConfigError(f"{where} has a field type ({f.type}) records do not support")
    name, default = _SCALARS[f.type]
    return (f"tuple[{name}, ...]", "()") if repeated else (f"{name} | None", "None") if _optional(f) else \
        (name, default)


def _comment_lines(text: str, indent: str, prefix: str) -> list[str]:
    return [f"{indent}{prefix}{line.strip()}".rstrip() for line in text.strip("\n").splitlines()]


def _record(name: str, message_name: str, index: dict[str, _Message], record_of: dict[str, str],
            named: set[str]) -> list[str]:
    """The record's source lines; the records its fields name are added to ``named``."""
    message = index[message_name]
    doc = message.comment.strip()
    if '"""' in doc or "\\" in doc:
        raise ConfigError(f"{message_name}'s comment cannot be a docstring (it holds quotes or backslashes)")
    lines = ["@dataclass(frozen=True, kw_only=True)", f"class {name}:", '    """' +
             (f"{doc.splitlines()[0].strip()}" if doc else f"The record of ``{message_name}``.")]
    lines += _comment_lines("\n".join(doc.splitlines()[1:]), "    ", "") if doc else []
    lines += ["", f"    The record of ``{message_name}``.", '    """', ""] if doc else ['    """', ""]
    for f, comment in zip(message.proto.field, message.field_comments):
        if f.type_name.lstrip(".") == ENVELOPE:
            continue
        annotation, default = _annotation(f, f"{message_name}.{f.name}", index, record_of)
        if f.type == _F.TYPE_MESSAGE and f.type_name.lstrip(".") in record_of:
            named.add(record_of[f.type_name.lstrip(".")])
        lines += _comment_lines(comment, "    ", "# ")
        lines.append(f"    {f.name}: {annotation}" + ("" if default is None else f" = {default}"))
    return lines + ["", ""]


def render(files: descriptor_pb2.FileDescriptorSet, module: str = MODULE) -> str:
    """The source of ``module`` (one of ``MODULES``) for the messages in ``files`` (with source
    info)."""
    index = _index(files)
    missing = [message for _, message in ALL_RECORDS if message not in index]
    if missing:
        raise ConfigError(f"record_gen.RECORDS names messages the protos do not define: {missing}")
    paths = [path for path, _ in MODULES]
    if module not in paths:
        raise ConfigError(f"record_gen writes {paths}, not {module!r}")
    record_of = {message: name for name, message in ALL_RECORDS}
    records = dict(MODULES)[module]
    named: set[str] = set()
    body: list[str] = []
    for name, message in records:
        body += _record(name, message, index, record_of, named)
    main = module == MODULE
    out = ['"""The plain records that an owner\'s work returns and its control calls carry, one per message.' if main
           else '"""The plain records the relay tree\'s calls carry (relay.proto), one per message.',
           "",
           "Generated by ``python -m zero_ray.control.codegen`` from protos/zero_ray/v1 (see",
           ":mod:`zero_ray.control.record_gen`): do not edit; change the .proto and regenerate. They are",
           "plain data: :mod:`zero_ray.control.conversion` alone turns them into messages and back.",
           '"""', "", "from __future__ import annotations", ""]
    mappings = any("Mapping[" in line for line in body)
    out += ["from collections.abc import Mapping"] if mappings else []
    out += ["from dataclasses import dataclass" + (", field" if mappings else "")]
    own = {name for name, _ in records}
    earlier = [(path, {n for n, _ in recs}) for path, recs in MODULES[:paths.index(module)]]
    for path, names in earlier:
        used = sorted((named - own) & names)
        if used:
            out += ["", f"from {path[:-3].replace('/', '.')} import {', '.join(used)}"]
    out += ["", ""] + body
    out.append("# The message each record is converted to and from (zero_ray.control.conversion).")
    out.append("MESSAGES: dict[str, str] = {")
    out += [f'    "{name}": "{message}",' for name, message in records]
    out += ["}"]
    if main:
        out += ['# Request fields of this type are the clients\' envelope, not record fields.', f'ENVELOPE = "{ENVELOPE}"']
    return "\n".join(out + [""])
