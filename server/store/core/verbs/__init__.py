"""The table core's verbs, what the rules and the tables call to change a table's records: leases
as records and what ending one does to its groups (leases.py), group records opened, members
added, failed runs and completion (groups.py) and a batch chosen, read and leased (take.py), over
how experiences leave (retire.py), the compute queue with a group's advantages stored
(compute.py), a replayed group requeued (requeue.py), a rows table's complete groups as
segments, states, directory entries and runs (segments.py, issue 64's disk/rows/), its ready
groups picked over its runs or indexes (row_select.py) as the runs they were picked in
(table_state/picks.py), moved (row_moves.py) and leased (row_leases.py), its pending groups
(row_pending.py), its deletes (row_deletes.py) and its replayed groups requeued (row_requeue.py),
over the rollouts held in pieces with their counters (pieces.py).

May import the core's rooms below: table_state/, ordering/; nothing of whole_table/.
"""
