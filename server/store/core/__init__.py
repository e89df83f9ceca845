"""The table core: the only code that reads and writes a table's records (item, group and lease
records, tombstones, the ready, pending, compute, retired and cooling indexes, the insertion
order, a table's counters, its rollouts held in pieces), in rooms that import only downward
(each room's `__init__.py` says what it holds), top to bottom:

- whole_table/: the work over a table's records as a whole: the format's upgrades at the open
  (migrate.py), the checks of its records (verify.py), reads of them off the writer and a page
  of them (reading.py);
- verbs/: the verbs on a table's records: leases as records and what ending one does to its
  groups (leases.py), group records opened, filled, failed and completed (groups.py), a batch
  chosen, read and leased (take.py), how experiences leave (retire.py), the compute queue and a
  group's advantages stored (compute.py), a replayed group placed anew or cooling (requeue.py),
  a rows table's complete groups as rows (segments.py: disk/rows/, which only the core writes),
  rollouts in pieces with their counters (pieces.py);
- table_state/: a table in one transaction and what it is made of: `TableState` (state.py), the
  rate limiter's counts (rate_counts.py), the events a table raises and `TableExtension`
  (events.py), the counters and their stored form (counters.py), what is checked of a payload
  before it leaves the store (read_check.py), the records behind the views it hands out
  (views.py: code outside the core reads a group and an experience as schema/views.py's
  `GroupView` and `MemberView`, never as records);
- ordering/: a table's ready indexes and their builds (ready.py), the orders and their registry
  (orders.py), the ready-group indexes (indexes.py).

What to do and when (sizes, timeouts, zero variance, capacity, the limiter's limits, staleness,
reuse's priorities, quarantine's choice of groups, partial rollouts' checks) is the rules'
(rules/) and the tables' (tables/): they call the core's verbs.

May import the rooms below: disk, schema. Every room above reaches a table's records through it.
"""
