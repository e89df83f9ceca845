"""What every layer of the store reads: the group states (states.py), a sample request
(sample_spec.py), a table's configuration (table_config.py) over its parts (table_parts.py),
the estimators a table can name (estimator_registry.py), and every refusal (errors.py) and the
order registry's names (order_names.py: the orders a request may name and their indexes'
databases, which the store opens; the registry itself is core/ordering/orders.py), in that order of
layers.

Imports nothing of the store's outside this room.
"""
