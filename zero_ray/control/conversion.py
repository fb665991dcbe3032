"""One conversion between the handlers' records and their protobuf messages, by field name.

Both walk the message's descriptor, so no message has a conversion of its own: a field added
to the .proto (and so, by codegen, to its record in ``zero_ray/core/records.py``) travels with no
change here, in the servicers or in the clients. A scalar is copied; ``repeated`` becomes a
tuple and back; a map a dict; a nested message its record (the class
:mod:`zero_ray.control.handlers` names for it, so that a ``Piece`` is checked on arrival); an
``optional`` message or scalar None when unset; an enum its number. The ``RequestHeader``
envelope is the caller's (``to_message(..., header=...)``).
"""

from __future__ import annotations

import enum
import functools
from typing import Any, TypeVar

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from zero_ray.control import handlers
from zero_ray.core import relay_records
from zero_ray.core.records import ENVELOPE, MESSAGES

R = TypeVar("R")
M = TypeVar("M", bound=Message)

# Message full name -> the record class built from it (the checking subclass where there is one).
_RECORD_OF: dict[str, type] = {message: getattr(handlers, name)
                               for name, message in {**MESSAGES, **relay_records.MESSAGES}.items()}


def record_class(descriptor: Descriptor) -> type:
    """The record class of a message type; KeyError for a message with no record."""
    return _RECORD_OF[descriptor.full_name]


# Cached per descriptor (a message type's, fixed at import): read for every field of every
# message converted, they were half of a relay's conversion time (GetOptions builds an object).
@functools.cache
def record_fields(descriptor: Descriptor) -> tuple[FieldDescriptor, ...]:
    """The message's fields that are its record's (all but the request envelope)."""
    return tuple(f for f in descriptor.fields if f.message_type is None or f.message_type.full_name != ENVELOPE)


@functools.cache
def _is_map(f: FieldDescriptor) -> bool:
    return f.message_type is not None and f.message_type.GetOptions().map_entry


def _unset_optional(message: Message, f: FieldDescriptor) -> bool:
    # An `optional` field (or a oneof member) reads back as None when it was not sent.
    return f.containing_oneof is not None and not message.HasField(f.name)


def _scalar(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _fill(message: Message, record: Any) -> None:
    for f in record_fields(message.DESCRIPTOR):
        value = getattr(record, f.name)
        target = getattr(message, f.name)
        if _is_map(f):
            value_field = f.message_type.fields_by_name["value"]
            for key, item in value.items():
                if value_field.message_type is None:
                    target[key] = _scalar(item)
                else:
                    _fill(target[key], item)
        elif f.is_repeated:
            if f.message_type is None:
                try:  # protobuf checks the items itself, in C: per item here, 8,192 indices cost 1.5 ms
                    target.extend(value)
                except TypeError:  # enum members among them: their values
                    del target[:]
                    target.extend(_scalar(item) for item in value)
            else:
                for item in value:
                    _fill(target.add(), item)
        elif value is None:
            continue  # an optional field left unset
        elif f.message_type is not None:
            target.SetInParent()  # present even when every field of it is a default
            _fill(target, value)
        else:
            setattr(message, f.name, _scalar(value))


def to_message(record: Any, message_type: type[M], **envelope: Any) -> M:
    """``record`` as a ``message_type``; ``envelope``: fields of the message that are not the
    record's (a request's ``header``)."""
    message = message_type(**envelope)
    _fill(message, record)
    return message


def _value(message: Message, f: FieldDescriptor) -> Any:
    value = getattr(message, f.name)
    if _is_map(f):
        value_type = f.message_type.fields_by_name["value"].message_type
        return {k: v if value_type is None else to_record(v, record_class(value_type)) for k, v in value.items()}
    if f.is_repeated:
        return tuple(value) if f.message_type is None else tuple(to_record(m, record_class(f.message_type))
                                                                 for m in value)
    if _unset_optional(message, f):
        return None
    return value if f.message_type is None else to_record(value, record_class(f.message_type))


def to_record(message: Message, record_type: type[R]) -> R:
    """``message`` as a ``record_type`` (nested messages as their records); a record that
    checks its values raises its ConfigError here."""
    return record_type(**{f.name: _value(message, f) for f in record_fields(message.DESCRIPTOR)})

