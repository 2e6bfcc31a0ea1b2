"""``swarm serve``: an OpenAI-compatible HTTP API over a ring, its metrics and its dashboard.

Rule: may import everything ``coordinator`` may, and ``coordinator``; never ``stage`` or ``cli``. Importing this
package imports nothing. Imports inside it: docs/architecture.md, "Serving".

- ``app``         the Starlette app and its routes; ``serve_api``: load the model, check the ring, listen, drain
- ``config``      ``ServeConfig``: every setting of ``swarm serve`` and its flag, in sections, validated
- ``state``       ``ServeState``: what every request shares (the ring, host, tokenizer, config, pool, counters)
- ``requests``    a body into a validated ``Request``, or an OpenAI-shaped ``ApiError``; size limits
- ``completion``  one request's generation on the ring: detokenizing, stop strings, receipts, ring errors
- ``stream``      server-sent events: the status after the ring's decision, chunks, keep-alives
- ``pool``        ``ClientPool``: ring clients with open streams, one per request in flight; rerouting
- ``lifecycle``   hang-ups, ``Shutdown`` and signals, the drain
- ``guard``       ``serve_http``: hypercorn over a capped listener; header and body deadlines, slow and idle clients
- ``params``      which OpenAI request fields are honoured, accepted as no-ops, or refused; body loading
- ``health``      ``ring_health``: every stage of the ring asked for its info
- ``metrics``     ``ServeMetrics``: Prometheus metrics and the recent requests the dashboard shows
- ``dashboard``   the live dashboard page and the JSON it polls
"""
