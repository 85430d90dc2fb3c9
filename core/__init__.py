"""The ground floor every app shares: Redis and database clients, shared Redis names, embedded services.

Nothing here imports an app (console, registry, serving, billing).
"""
