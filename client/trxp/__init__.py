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
and from Experience objects for users. The parts: common.py (layout, types),
parse.py, pickles.py (the metadata pickle's scan), unpickler.py, checks.py (validation), build.py
(building and splicing), convert.py (Experience objects and torch tensors), advantages/worker.py
(advantages of one value per experience as tensors, on either side of a sample).
"""

from ..native import use_compiled

# parse, checks, pickles and common compiled with mypyc where `make setup` or the wheel built them (see native.py).
use_compiled(__name__, __path__)

from .advantages import attach as attach_advantages
from .build import build, pack_item
from .common import (
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
from .convert import decode, decode_reply, encode, from_experience, gather, raw_of, tensor_of, to_experience
from .parse import parse
from .splice import join, join_parts

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
