"""The records and their messages come from one definition, the .proto: every record has
exactly its message's fields, every field of every record survives the wire, and a field added
to a .proto reaches its record through codegen alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from zero_ray.control import codegen, handlers, record_gen
from zero_ray.control._generated import common_pb2, coordinator_pb2, owner_pb2, relay_pb2
from zero_ray.core import records as generated
from zero_ray.core import relay_records
from zero_ray.control.conversion import record_fields, to_message, to_record
from zero_ray.errors import ConfigError

# Every record, of both generated modules (relay.proto's are a module of their own).
MESSAGES = {**generated.MESSAGES, **relay_records.MESSAGES}
NAMES = sorted(MESSAGES)


def _message_type(record_name: str) -> type:
    short = MESSAGES[record_name].rsplit(".", 1)[1]
    return next(getattr(module, short) for module in (owner_pb2, coordinator_pb2, relay_pb2, common_pb2)
                if hasattr(module, short))


def _scalar(f: Any, salt: int) -> Any:
    """A value unlike the default and unlike any other field's, so a swap or a loss shows."""
    if f.type == f.TYPE_BOOL:
        return True
    if f.type in (f.TYPE_DOUBLE, f.TYPE_FLOAT):
        return f.number + 0.5 + salt
    if f.type == f.TYPE_STRING:
        return f"{f.name}-{salt}"
    if f.type == f.TYPE_BYTES:
        return f"{f.name}-{salt}".encode()
    return 100 * f.number + salt  # integers and enum numbers


# A Piece names a staged batch or a dataset, never both: the two forms cover its fields.
PIECE_FORMS = ({"batch_key": ""}, {"dataset": "", "indices": ()})


def _relay_step_fields(values: dict[str, Any], salt: int) -> dict[str, Any]:
    """A relayed step's fields must agree (spans ascending, a count per rank, the indices they
    count, none in the common piece): non-default values that do."""
    step = values["step"]
    return {"step": dataclasses.replace(step, piece=handlers.Piece(dataset=f"dataset-{salt}")),
            "ranks": (handlers.RankSpan(start=3 + salt, stop=5 + salt), handlers.RankSpan(start=9 + salt, stop=10 + salt)),
            "counts": (2, 0, 1), "indices": (11 + salt, 12, 13)}


def _relay_evaluate_fields(values: dict[str, Any], salt: int) -> dict[str, Any]:
    """A relayed evaluation's fields agree as a relayed step's do."""
    evaluate = values["evaluate"]
    return {"evaluate": dataclasses.replace(evaluate, piece=handlers.Piece(dataset=f"dataset-{salt}")),
            "ranks": (handlers.RankSpan(start=3 + salt, stop=5 + salt), handlers.RankSpan(start=9 + salt, stop=10 + salt)),
            "counts": (2, 0, 1), "indices": (11 + salt, 12, 13)}


# Records whose fields check each other: the values that agree, given the generic ones.
def _relay_call_fields(values: dict[str, Any], salt: int) -> dict[str, Any]:
    """A forwarded call names a method relays forward, and ascending spans."""
    return {"method": sorted(handlers.FORWARDED_METHODS)[salt % len(handlers.FORWARDED_METHODS)],
            "ranks": (handlers.RankSpan(start=3 + salt, stop=5 + salt), handlers.RankSpan(start=9 + salt, stop=10 + salt))}


AGREEING = {"RelayStepArgs": _relay_step_fields, "RelayEvaluateArgs": _relay_evaluate_fields,
            "RelayCallArgs": _relay_call_fields}


def _sample(record_name: str, salt: int = 0, without: dict[str, Any] | None = None) -> Any:
    """A record with a non-default value in every field (but those ``without`` names)."""
    descriptor = _message_type(record_name).DESCRIPTOR
    values: dict[str, Any] = {}
    for f in record_fields(descriptor):
        nested = f.message_type
        if nested is not None and nested.GetOptions().map_entry:
            values[f.name] = {f"k{salt}": _scalar(nested.fields_by_name["value"], salt), "other": _scalar(
                nested.fields_by_name["value"], salt + 1)}
        elif nested is not None:
            name = next(n for n, m in MESSAGES.items() if m == nested.full_name)
            forms = PIECE_FORMS[0] if name == "Piece" else None
            made = (_sample(name, salt + 1, forms), _sample(name, salt + 2, forms))
            values[f.name] = made if f.is_repeated else made[0]
        else:
            values[f.name] = (_scalar(f, salt), _scalar(f, salt + 3)) if f.is_repeated else _scalar(f, salt)
    if record_name in AGREEING:
        values.update(AGREEING[record_name](values, salt))
    values.update(without or {})
    return getattr(handlers, record_name)(**values)


CASES = [(name, None) for name in NAMES if name != "Piece"] + [("Piece", form) for form in PIECE_FORMS]


@pytest.mark.parametrize(("record_name", "without"), CASES)
def test_every_field_of_every_record_survives_the_wire(record_name: str, without: dict[str, Any] | None) -> None:
    record = _sample(record_name, without=without)
    message_type = _message_type(record_name)
    wire = to_message(record, message_type).SerializeToString()
    message = message_type.FromString(wire)
    sent = {f.name for f, _ in message.ListFields()}
    expected = {f.name for f in record_fields(message_type.DESCRIPTOR)} - set(without or {})
    assert sent == expected, f"fields that did not travel: {sorted(expected - sent)}"
    back = to_record(message, type(record))
    assert back == record
    assert type(back) is type(record)


@pytest.mark.parametrize("record_name", NAMES)
def test_a_record_has_its_messages_fields_exactly(record_name: str) -> None:
    record_type = getattr(handlers, record_name)
    assert dataclasses.is_dataclass(record_type)
    assert issubclass(record_type, getattr(generated if record_name in generated.MESSAGES else relay_records,
                                                  record_name))  # the generated one, or a checking subclass
    names = [f.name for f in dataclasses.fields(record_type)]
    assert names == [f.name for f in record_fields(_message_type(record_name).DESCRIPTOR)]
    with pytest.raises(dataclasses.FrozenInstanceError):
        setattr(_sample(record_name, without=PIECE_FORMS[0] if record_name == "Piece" else None), names[0], None)


def test_an_unset_optional_message_is_none_and_a_default_one_is_present() -> None:
    status = _sample("OwnerStatus")
    for layout in (None, handlers.ModelLayout()):
        record = dataclasses.replace(status, layout=layout)
        message = owner_pb2.OwnerStatusReply.FromString(
            to_message(record, owner_pb2.OwnerStatusReply).SerializeToString())
        assert message.HasField("layout") is (layout is not None)
        assert to_record(message, handlers.OwnerStatus) == record


def test_a_nested_record_is_checked_on_arrival() -> None:
    # An empty piece names neither a batch nor a dataset: the subclass's check runs in to_record.
    request = owner_pb2.StepRequest(step=1, global_samples=2)
    with pytest.raises(ConfigError, match="exactly one"):
        to_record(request, handlers.StepArgs)


def test_the_request_envelope_is_the_callers() -> None:
    header = common_pb2.RequestHeader(job_id="job-1", protocol_version=3)
    message = to_message(_sample("StepArgs"), owner_pb2.StepRequest, header=header)
    assert message.header.job_id == "job-1"
    assert "header" not in {f.name for f in dataclasses.fields(handlers.StepArgs)}


def _copied_protos(tmp_path: Path) -> Path:
    """The committed .proto files copied under ``tmp_path`` (to edit); returns the folder."""
    pytest.importorskip("grpc_tools", reason="grpcio-tools (the test extra) regenerates the records")
    protos = tmp_path / "protos"
    protos.mkdir()
    for name in codegen.PROTO_FILES:
        (protos / name).write_text((codegen.default_proto_dir() / name).read_text())
    return protos


def test_a_new_proto_field_reaches_its_record_through_codegen_alone(tmp_path: Path) -> None:
    protos = _copied_protos(tmp_path)
    owner = protos / "owner.proto"
    text = owner.read_text()
    anchor = "  double data_seconds = 13;\n"
    assert anchor in text
    owner.write_text(text.replace(anchor, anchor + "  // Seconds spent waiting for peers.\n"
                                                   "  double wait_seconds = 14;\n"
                                                   "  repeated string notes = 15;\n"))
    codegen.generate(tmp_path / "out", protos)
    source = (tmp_path / "out" / record_gen.MODULE).read_text()
    namespace: dict[str, Any] = {}
    exec(compile(source, "records.py", "exec"), namespace)  # noqa: S102 (our own generated source)
    fields = {f.name: f for f in dataclasses.fields(namespace["StepResult"])}
    assert list(fields)[-2:] == ["wait_seconds", "notes"]
    assert fields["wait_seconds"].type == "float" and fields["wait_seconds"].default == 0.0
    assert fields["notes"].type == "tuple[str, ...]" and fields["notes"].default == ()
    assert "    # Seconds spent waiting for peers.\n    wait_seconds: float = 0.0\n" in source
    # The committed records are what the committed protos give (a new field needs codegen only).
    assert source.replace("    # Seconds spent waiting for peers.\n    wait_seconds: float = 0.0\n"
                          "    notes: tuple[str, ...] = ()\n", "") == \
        (Path(generated.__file__)).read_text()


def test_a_message_field_of_a_type_with_no_record_is_refused(tmp_path: Path) -> None:
    protos = _copied_protos(tmp_path)
    owner = protos / "owner.proto"
    owner.write_text(owner.read_text().replace("  double data_seconds = 13;\n",
                                               "  double data_seconds = 13;\n  AbortReply abort = 14;\n"))
    with pytest.raises(ConfigError, match="AbortReply, which has no record"):
        codegen.generate(tmp_path / "out", protos)
