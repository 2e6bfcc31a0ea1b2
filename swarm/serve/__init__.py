"""``swarm serve``: an OpenAI-compatible HTTP API over a ring, its metrics and its dashboard.

Layout (each module's docstring says what it owns and may import):

- ``app``        the Starlette app, request parsing and lifecycle, streaming, the client pool, drain
- ``params``     which OpenAI request fields are honoured, accepted as no-ops, or refused; body loading
- ``health``     ``ring_health``: every stage of the ring asked for its info
- ``metrics``    ``ServeMetrics``: Prometheus metrics and the recent requests the dashboard shows
- ``dashboard``  the live dashboard page and the JSON it polls

Rule: may import everything ``coordinator`` may, and ``coordinator``; never ``stage`` or ``cli``.
Importing this package imports nothing.
"""
