"""The TRXP v1 payload, byte-compatible with Trinity-RFT's Experience.serialize_many (the
package's docstring says its layout): common.py (the layout's constants and types), parse.py,
pickles.py (the metadata pickle's scan), unpickler.py, checks.py (validation), measure.py (the
expansion bound's measure of the metadata), shown.py (untrusted values in refusal messages),
build.py (a batch as Trinity-RFT writes it, an item as the store keeps it), stream.py (a payload
read as it arrives), convert.py (Experience objects and torch tensors), advantages.py (advantages
of one value per experience as tensors, on either side of a sample), segments.py (per-token policy
versions), partial.py (rollouts pushed in pieces) and gc_pause.py (the garbage collector held off
while a batch decodes). No protobuf; torch only in convert.py,
only when tensors are made.
"""

from ...native import use_compiled

# parse, checks, measure, shown, pickles, canonical, build and common compiled with mypyc where
# `make setup` or the wheel built them (see native.py).
use_compiled(__name__, __path__)
