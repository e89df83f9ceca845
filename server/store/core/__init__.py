"""The table core: the only code that reads and writes a table's records (item, group and lease
records, tombstones, the ready, pending, compute, retired and cooling indexes, the insertion
order, a table's counters, its rollouts held in pieces), in layers, top to bottom:

- migrate.py (the format's upgrades at the open), verify.py (the checks of a table's records),
  reading.py (reads of its records off the writer, and a page of them);
- leases.py (leases as records, and what ending one does to its groups), groups.py (group records:
  opened, members added, failed runs, completed), take.py (a batch chosen, read and leased);
- retire.py (how experiences leave: tombstones, pruning, Delete, quarantined tombstones),
  compute.py (the compute queue and a group's advantages stored), requeue.py (a replayed group
  placed anew or cooling);
- rate_counts.py (the rate limiter's counts), pieces.py (rollouts in pieces with their counters);
- state.py (`TableState`: a table in one transaction, its record cache, counters, ready indexes);
- ready.py (a table's ready indexes and their builds), orders.py (the orders and their registry),
  indexes.py (the ready-group indexes);
- events.py (the events a table raises, and `TableExtension`), counters.py (the counters and their
  stored form), read_check.py (what is checked of a payload before it leaves the store);
- views.py (the records behind the views it hands out: code outside the core reads a group and
  an experience as schema/views.py's `GroupView` and `MemberView`, never as records).

What to do and when (sizes, timeouts, zero variance, capacity, the limiter's limits, staleness,
reuse's priorities, quarantine's choice of groups, partial rollouts' checks) is the rules'
(rules/) and the tables' (tables/): they call the core's verbs.

May import the rooms below: disk, schema. Every room above reaches a table's records through it.
"""
