"""Know: where memory went, from a memory snapshot.

``sites`` replays a snapshot's allocation history and groups it by Python call site;
``timeline`` renders it as a self-contained HTML page. ``vramkit run``, the leak watch and the
pytest plugin read their reports through these.
"""
