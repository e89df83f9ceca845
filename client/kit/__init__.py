"""What the framework adapters share, so that each is the framework's own shape over one kit: a
reader's leases kept alive while it lives, and acknowledged or given back (`lease_keeper.py`), a
batch taken only once the server has stored its delivery (`batches.py`), where a buffer lives (`location.py`:
an `expbuf://` path with its token and TLS), a table's settings looked up by name and checked
for what the adapter needs (`tables.py`), and the pauses while the server is out of reach
(`retry.py`: one policy, the clients' own backoff). The adapters (trinity/, verl/, areal/, trl/, torchrl/)
import the kit; the kit imports the clients, never an adapter or a framework.
"""
