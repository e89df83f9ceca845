"""The payloads the server stored, read without a parse of their metadata: pieces.py (a
payload whose tensor section lies in pieces, views of the store's map), splice.py (a batch
spliced from them, and their headers read), entries.py (that batch's header written) and
columns.py (a reply's columns cut from them). No protobuf, no torch: the store reads its
payloads with them. All four are compiled with mypyc where `make setup` or the wheel built them (see
native.py): a sample reply's build is most of an RPC thread's share of a consume.
"""

from ...native import use_compiled

use_compiled(__name__, __path__)
