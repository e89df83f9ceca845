"""One client for many expbuf shards: the blocking and asyncio sharded clients and their pushers.

`blocking.py` and `aio.py` are the two clients; `plans.py`, `sampling.py`, `reads.py`, `values.py`,
`ledger.py` and `poll.py` are the logic free of I/O they both run (where a group goes, the ledger's
calls over shards, how a batch is gathered), `steps.py` what a plan yields, `routes.py` all of
those plans in one class (each declared call's route names one: rpc/declare.py), `common.py` their
errors and batches, `pusher.py` their pipelined pushes. The shards import the one-server clients,
the pushers, `rpc/` and `schema/`; nothing below imports them.
"""
