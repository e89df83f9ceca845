"""A push's path through the service: its PushRequest read by hand (push_request.py), the payload
bytes pushes hold under max_inflight_bytes (inflight.py) and their admission and reading
(push_memory.py, an interceptor; a push in chunks read, staged and paced by push_chunks.py), their
decoding and staging (ingest.py, its processes running ingest_worker.py) and a PushStream's
pipeline (push_stream.py).

May import the service's shared modules and interceptors/; nothing of servicers/ or sample/.
"""
