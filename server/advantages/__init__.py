"""Advantages: the estimators (estimators.py) and reward shaping (shaping.py) in batched
torch code, the worker that computes them for completed groups (worker.py) and its start once
a table needs it and torch has loaded (start.py), the batch stage over a sampled batch, where a
table's advantages can be computed (devices.py), and the running reward moments (moments.py,
without torch).

May import config and the store; nothing of rpc, app, cli or commands.
"""
