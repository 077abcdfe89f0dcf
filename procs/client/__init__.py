"""The pieces of the API process's engine client (``procs/engine_client.py`` composes them):
supervision, routing, output demultiplexing, hold/resume and utility calls."""
