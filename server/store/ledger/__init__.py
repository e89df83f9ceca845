"""The prompt ledger: its rules over a table's datasets and claims (rules.py, one table
extension composed of a class a job: datasets.py, claim_life.py, outcomes.py, claimants.py),
its check at open (check.py), its stored records (records.py) and the split of a dataset over
shards (shards.py). Its calls are the services' (services/claims.py).

May import the rooms below: rules, disk, schema. Reached only from tables, services and the
engine (the import contracts).
"""
