"""The table core's verbs, what the rules and the tables call to change a table's records: leases
as records and what ending one does to its groups (leases.py), group records opened, members
added, failed runs and completion (groups.py) and a batch chosen, read and leased (take.py), over
how experiences leave (retire.py), the compute queue with a group's advantages stored
(compute.py), a replayed group requeued (requeue.py), over a rows table's verbs (rows/: issue 64's
segments, runs, pending groups, moves, leases, deletes), over the payloads stored and dropped
(payloads.py) and the rollouts held in pieces with their counters (pieces.py).

May import the core's rooms below: table_state/, ordering/; nothing of whole_table/.
"""
