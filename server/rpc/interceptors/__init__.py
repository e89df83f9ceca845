"""The server's interceptors, at the bottom of the service: their base (base.py: ExperienceBuffer
methods only, each handler made once, all given to gRPC as one; and `refuse`, the one way a call
is refused), bearer tokens with scopes (auth.py), the bounds on concurrent calls (limits.py),
Prometheus metrics (metrics.py) and requests that do not parse (unreadable.py). The interceptors
that hold a call's bytes (push/push_memory.py) or watch its sends (sample/stalled_sends.py) live
with the calls they serve.

Imports nothing of the service's outside this room.
"""
