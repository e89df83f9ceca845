"""What a Sample stream sends: its conversation, a batch when asked and delivered when confirmed
(sample_stream.py, over the batches sent and not yet delivered, window.py, and what its client
said, client_side.py), replies serialised once, which the reads send too (replies.py), and the end of
a call whose client takes no more of its replies (stalled_sends.py, an interceptor).

May import the service's shared modules and interceptors/; nothing of servicers/ or push/.
"""
