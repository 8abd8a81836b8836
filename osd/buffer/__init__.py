"""The log buffer between replicas and the trainer: what the target thought, on a Redis stream.

Owns: the record of one finished request (``record``) and its versioned, checksummed binary
form (``wire``), the replica's non-blocking writer (``writer``), the trainer's consumer-group
reader (``reader``), the stream's memory bound (``stream_budget``) and what Redis says about it
(``stream_info``), the trainer's heartbeat hash (``loop_status``) and a private local
``redis-server`` with the client settings all of them share (``redis_server``). ``record`` and
``wire`` are pure; the rest may import redis and subprocess. Never imports serving, the trainer,
the decode loop or the adapters.
"""
