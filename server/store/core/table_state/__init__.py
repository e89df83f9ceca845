"""A table in one transaction and what it is made of: the rate limiter's counts (rate_counts.py)
and a rows table's index of its oldest live members (oldest_index.py: stats' oldest age), over
`TableState`, the table's record cache, counters and ready indexes, written by `save`
(state.py), over the events it raises and `TableExtension` (events.py), the counters and their
stored form (counters.py), what is checked of a payload before it leaves the store
(read_check.py), a rows table's groups picked for a verb as the runs they were picked in
(picks.py), and the records behind the views the core hands out (views.py).

May import the core's room below: ordering/ (a table's ready indexes); nothing of verbs/ or
whole_table/.
"""
