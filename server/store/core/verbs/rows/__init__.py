"""A rows table's verbs (issue 64's disk/rows/): its complete groups as segments, states, directory
entries and runs (segments.py), its pending groups as pushes meet them (pending.py) and as they
end, complete or leave (ends.py), its ready groups picked over its runs or indexes (select.py) as
the runs they were picked in (table_state/picks.py), moved (moves.py) and leased (leases.py), its
deletes (deletes.py) and its replayed groups requeued (requeue.py).

May import the verbs below them (payloads.py, pieces.py) and the core's rooms below the verbs.
"""
