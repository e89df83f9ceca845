"""TRXP v1 codec, byte-compatible with Trinity-RFT's Experience.serialize_many.

Layout: b"TRXP" · version u8 = 1 · metadata length u64 LE · tensor length u64 LE ·
metadata (pickle of {"version", "num_items", "items"}) · safetensors blob whose keys
are "{i}:{field}" and "{i}:multi_modal_inputs:{key}".

Payloads come from the network, so decoding trusts nothing: the pickle is scanned
opcode by opcode before a restricted unpickler (plain data only, no globals) reads
it, every length is checked against the bytes actually present before anything is
allocated, and what the server relies on later (eids, integer tokens, consistent
response lengths) is validated, all within a work budget proportional to the
payload's size. Every failure is a TrxpError naming the item and field.

Two levels: `parse`/`build` work on RawItem (metadata plus raw tensor bytes, no
torch), which is what the server stores and batches; `decode`/`encode` convert to
and from Experience objects for users.

The package's rooms, one format each (docs/internals/layout.md):
- codec/: the TRXP payload itself: its layout and types (common.py), the parse (parse.py, the
  metadata pickle's scan in pickles.py, its unpickler, the checks), the build, a payload read as
  it arrives (stream.py), Experience objects and torch tensors (convert.py, the only module that
  imports torch, and only when tensors are made), advantages on the bytes, version segments and
  partial rollouts; parse, checks, pickles and common (and the modules they call) compiled with mypyc where built;
- stored/: the payloads the server stored, read without a parse: a tensor section in pieces,
  batches spliced from them (join), the columns of a reply cut from them;
- column_batch/: a push as columns (the ColumnBatch payload): made from a worker's tensors,
  written and read with protobuf, read into the items a TRXP push makes;
- varints.py: protobuf's varints, for messages written or read by hand.

The store imports codec/, stored/ and varints.py, which import no protobuf (a checked contract),
never column_batch/.
"""

from .codec.advantages import attach as attach_advantages
from .codec.build import build, pack_item
from .codec.common import (
    EXPANSION_BASE,
    EXPANSION_PER_BYTE,
    HEADER_SIZE,
    MAGIC,
    MAX_NESTING,
    MAX_UID_BYTES,
    MM_PREFIX,
    VERSION,
    WORK_BASE,
    WORK_PER_BYTE,
    MetadataLimit,
    RawItem,
    RawTensor,
    TrxpError,
    Work,
)
from .codec.convert import decode, decode_reply, encode, from_experience, gather, raw_of, tensor_of, to_experience
from .codec.parse import parse
from .stored.splice import join, join_parts

__all__ = [
    "EXPANSION_BASE",
    "EXPANSION_PER_BYTE",
    "HEADER_SIZE",
    "MAGIC",
    "MAX_NESTING",
    "MAX_UID_BYTES",
    "MM_PREFIX",
    "VERSION",
    "WORK_BASE",
    "WORK_PER_BYTE",
    "MetadataLimit",
    "RawItem",
    "RawTensor",
    "TrxpError",
    "Work",
    "attach_advantages",
    "build",
    "decode",
    "decode_reply",
    "encode",
    "from_experience",
    "gather",
    "join",
    "join_parts",
    "pack_item",
    "parse",
    "raw_of",
    "tensor_of",
    "to_experience",
]
