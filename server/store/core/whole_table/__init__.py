"""The work over a table's records as a whole, at the top of the table core: the data directory's
format brought up to date at the open, and the indexes of the registered orders built or dropped
(migrate.py); the checks of a table's records against their states, indexes and counters
(verify.py); reads of its records off the writer or in it, the live experiences oldest first and
a bounded page of them (reading.py). The three know nothing of each other.

May import the core's rooms below: verbs/, table_state/, ordering/.
"""
