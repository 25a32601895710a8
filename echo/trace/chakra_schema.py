"""The Chakra execution-trace (ET) schema, written out field by field, and its file framing.

Chakra (MLCommons; consumed by ASTRA-sim) defines its graphs in ``schema/protobuf/et_def.proto``,
package ``ChakraProtoMsg``. No Chakra package installs here, so the schema is built in code from
that definition, schema version 0.0.4 (the version ASTRA-sim 2.x reads, ``GlobalMetadata.version``)
and encoded by the ``protobuf`` library. What is defined, with the field numbers of the .proto:

- ``AttributeProto``: ``name`` (1), ``doc_string`` (2) and one value of a ``oneof``: double (3),
  float (5), int32 (7), int64 (9), uint32 (11), uint64 (13), sint32 (15), sint64 (17),
  fixed32 (19), fixed64 (21), sfixed32 (23), sfixed64 (25), bool (27), string (29), bytes (31),
  each with a list form one number above (``DoubleList`` ... ``BytesList``: ``repeated values = 1``);
- ``GlobalMetadata``: ``version`` (1), ``attr`` (2) - the first message of a file;
- ``NodeType``: INVALID_NODE 0, METADATA_NODE 1, MEM_LOAD_NODE 2, MEM_STORE_NODE 3, COMP_NODE 4,
  COMM_SEND_NODE 5, COMM_RECV_NODE 6, COMM_COLL_NODE 7;
- ``CollectiveCommType``: ALL_REDUCE 0, REDUCE 1, ALL_GATHER 2, GATHER 3, SCATTER 4, BROADCAST 5,
  ALL_TO_ALL 6, REDUCE_SCATTER 7, REDUCE_SCATTER_BLOCK 8, BARRIER 9;
- ``Node``: ``id`` (1, uint64), ``name`` (2), ``type`` (3, NodeType), ``ctrl_deps`` (4) and
  ``data_deps`` (5) (repeated uint64: ids of nodes this one waits for), ``start_time_micros`` (6),
  ``duration_micros`` (7), ``inputs`` (8) / ``outputs`` (9) (``IOInfo``: ``values``, ``shapes``,
  ``types`` strings), ``attr`` (10, repeated AttributeProto);
- ``Tensor``: ``tensor_id``, ``storage_id``, ``offset``, ``num_elem``, ``elem_bytes``, ``device``.

Node attributes with a meaning to the simulators (Chakra's ``et_feeder_node``, by name and value
type): ``is_cpu_op`` (bool), ``num_ops`` (int64: FLOPs), ``tensor_size`` (uint64: bytes moved),
``comm_type`` (int64: a CollectiveCommType), ``comm_size`` (int64: bytes), ``comm_src``,
``comm_dst``, ``comm_tag``, ``comm_priority`` (int32) and ``pg_name`` (string: the process group).

A file is a sequence of messages, each preceded by its length as a varint (Chakra's
``protolib.encodeMessage``): one GlobalMetadata, then the nodes.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import cache
from typing import BinaryIO

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SCHEMA_VERSION = "0.0.4"
PACKAGE = "ChakraProtoMsg"

NODE_TYPES = ("INVALID_NODE", "METADATA_NODE", "MEM_LOAD_NODE", "MEM_STORE_NODE", "COMP_NODE",
              "COMM_SEND_NODE", "COMM_RECV_NODE", "COMM_COLL_NODE")
COLLECTIVE_TYPES = ("ALL_REDUCE", "REDUCE", "ALL_GATHER", "GATHER", "SCATTER", "BROADCAST", "ALL_TO_ALL",
                    "REDUCE_SCATTER", "REDUCE_SCATTER_BLOCK", "BARRIER")
NODE_TYPE = {name: i for i, name in enumerate(NODE_TYPES)}
COLLECTIVE_TYPE = {name: i for i, name in enumerate(COLLECTIVE_TYPES)}

# the oneof's scalar kinds in field-number order: (name prefix, protobuf type); list form = number + 1
_VALUE_KINDS = (("double", "TYPE_DOUBLE"), ("float", "TYPE_FLOAT"), ("int32", "TYPE_INT32"),
                ("int64", "TYPE_INT64"), ("uint32", "TYPE_UINT32"), ("uint64", "TYPE_UINT64"),
                ("sint32", "TYPE_SINT32"), ("sint64", "TYPE_SINT64"), ("fixed32", "TYPE_FIXED32"),
                ("fixed64", "TYPE_FIXED64"), ("sfixed32", "TYPE_SFIXED32"), ("sfixed64", "TYPE_SFIXED64"),
                ("bool", "TYPE_BOOL"), ("string", "TYPE_STRING"), ("bytes", "TYPE_BYTES"))


class ChakraError(ValueError):
    """A file that is not a Chakra ET of the supported schema version."""


def _field(msg, name: str, number: int, ftype: str, label: str = "LABEL_OPTIONAL", type_name: str = "",
           oneof: int | None = None):
    f = msg.field.add(name=name, number=number,
                      type=getattr(descriptor_pb2.FieldDescriptorProto, ftype),
                      label=getattr(descriptor_pb2.FieldDescriptorProto, label))
    if type_name:
        f.type_name = f".{PACKAGE}.{type_name}"
    if oneof is not None:
        f.oneof_index = oneof
    return f


def _file() -> descriptor_pb2.FileDescriptorProto:
    fd = descriptor_pb2.FileDescriptorProto(name="echo_chakra_et_def.proto", package=PACKAGE, syntax="proto3")
    attr = fd.message_type.add(name="AttributeProto")
    _field(attr, "name", 1, "TYPE_STRING")
    _field(attr, "doc_string", 2, "TYPE_STRING")
    attr.oneof_decl.add(name="value")
    for i, (kind, ftype) in enumerate(_VALUE_KINDS):
        list_name = kind.capitalize() + "List"
        _field(attr, f"{kind}_val", 3 + 2 * i, ftype, oneof=0)
        _field(attr, f"{kind}_list", 4 + 2 * i, "TYPE_MESSAGE", type_name=list_name, oneof=0)
        lst = fd.message_type.add(name=list_name)
        _field(lst, "values", 1, ftype, "LABEL_REPEATED")
    meta = fd.message_type.add(name="GlobalMetadata")
    _field(meta, "version", 1, "TYPE_STRING")
    _field(meta, "attr", 2, "TYPE_MESSAGE", "LABEL_REPEATED", "AttributeProto")
    for enum_name, values in (("NodeType", NODE_TYPES), ("CollectiveCommType", COLLECTIVE_TYPES)):
        enum = fd.enum_type.add(name=enum_name)
        for i, v in enumerate(values):
            enum.value.add(name=v, number=i)
    io = fd.message_type.add(name="IOInfo")
    for i, name in enumerate(("values", "shapes", "types")):
        _field(io, name, i + 1, "TYPE_STRING")
    node = fd.message_type.add(name="Node")
    _field(node, "id", 1, "TYPE_UINT64")
    _field(node, "name", 2, "TYPE_STRING")
    _field(node, "type", 3, "TYPE_ENUM", type_name="NodeType")
    _field(node, "ctrl_deps", 4, "TYPE_UINT64", "LABEL_REPEATED")
    _field(node, "data_deps", 5, "TYPE_UINT64", "LABEL_REPEATED")
    _field(node, "start_time_micros", 6, "TYPE_UINT64")
    _field(node, "duration_micros", 7, "TYPE_UINT64")
    _field(node, "inputs", 8, "TYPE_MESSAGE", type_name="IOInfo")
    _field(node, "outputs", 9, "TYPE_MESSAGE", type_name="IOInfo")
    _field(node, "attr", 10, "TYPE_MESSAGE", "LABEL_REPEATED", "AttributeProto")
    tensor = fd.message_type.add(name="Tensor")
    for i, (name, ftype) in enumerate((("tensor_id", "TYPE_UINT64"), ("storage_id", "TYPE_UINT64"),
                                       ("offset", "TYPE_UINT64"), ("num_elem", "TYPE_UINT64"),
                                       ("elem_bytes", "TYPE_UINT64"), ("device", "TYPE_STRING"))):
        _field(tensor, name, i + 1, ftype)
    return fd


@cache
def messages() -> dict[str, type]:
    """Message classes by name: Node, GlobalMetadata, AttributeProto, IOInfo, Tensor, the lists."""
    pool = descriptor_pool.DescriptorPool()
    fd = _file()
    pool.Add(fd)
    return {m.name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"{PACKAGE}.{m.name}"))
            for m in fd.message_type}


# --- attributes -----------------------------------------------------------------------------------
def attr(name: str, value, kind: str | None = None):
    """An AttributeProto; ``kind`` (int64, uint64, int32, double, bool, string, ...; ``*_list`` for a
    list) from the value's Python type when not given."""
    msg = messages()["AttributeProto"](name=name)
    if kind is None:
        kind = ("bool" if isinstance(value, bool) else "int64" if isinstance(value, int) else
                "double" if isinstance(value, float) else "string" if isinstance(value, str) else "")
        if isinstance(value, list | tuple):
            first = value[0] if value else ""
            kind = ("int64" if isinstance(first, int) and not isinstance(first, bool) else
                    "double" if isinstance(first, float) else "string") + "_list"
    if not kind:
        raise TypeError(f"attribute {name}: no Chakra value type for {type(value).__name__}")
    if kind.endswith("_list"):
        getattr(msg, kind).values.extend(value)
    else:
        setattr(msg, f"{kind}_val", value)
    return msg


def attr_value(a):
    """The Python value of an AttributeProto (a list for a *_list value; None when unset)."""
    which = a.WhichOneof("value")
    if which is None:
        return None
    value = getattr(a, which)
    return list(value.values) if which.endswith("_list") else value


# --- files ------------------------------------------------------------------------------------
def _write_varint(out: BinaryIO, value: int) -> None:
    while True:
        bits = value & 0x7F
        value >>= 7
        out.write(bytes([bits | 0x80 if value else bits]))
        if not value:
            return


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise ChakraError("a message length runs past the end of the file (truncated)")
        b = data[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ChakraError("a message length longer than 10 bytes: not a Chakra ET")


def write_messages(out: BinaryIO, msgs) -> None:
    """Length-delimited messages, as Chakra's protolib.encodeMessage writes them."""
    for m in msgs:
        body = m.SerializeToString()
        _write_varint(out, len(body))
        out.write(body)


def read_file(data: bytes, where: str) -> tuple[object, Iterator]:
    """(GlobalMetadata, nodes) of a Chakra ET file's bytes; ChakraError naming ``where`` and the
    reason when it is no Chakra ET of this schema version."""
    msgs = messages()
    pos = 0
    try:
        size, pos = _read_varint(data, 0)
        if pos + size > len(data):
            raise ChakraError("the metadata message runs past the end of the file (truncated)")
        meta = msgs["GlobalMetadata"].FromString(data[pos:pos + size])
    except ChakraError as exc:
        raise ChakraError(f"{where}: {exc}") from None
    except Exception as exc:  # protobuf's DecodeError
        raise ChakraError(f"{where}: not a Chakra ET (its first message is no GlobalMetadata: {exc})") from None
    if meta.version != SCHEMA_VERSION:
        raise ChakraError(f"{where}: Chakra schema version '{meta.version or '(none)'}'; Echo reads "
                          f"{SCHEMA_VERSION}")
    pos += size

    def nodes():
        p = pos
        while p < len(data):
            try:
                n, p = _read_varint(data, p)
                if p + n > len(data):
                    raise ChakraError("a node runs past the end of the file (truncated)")
                yield msgs["Node"].FromString(data[p:p + n])
            except ChakraError as exc:
                raise ChakraError(f"{where}: {exc}") from None
            except Exception as exc:
                raise ChakraError(f"{where}: unreadable node at byte {p}: {exc}") from None
            p += n

    return meta, nodes()
