"""Pipelined pushes: a window of pushes in flight over one PushStream.

`pipeline.py` is what the blocking pusher (`blocking.py`) and the asyncio one (`aio.py`) share: the
window, the messages, what an answer means. The pushers import `rpc/` and `schema/`, never the
clients that make them.
"""
