"""The gateway's OpenAI-compatible HTTP API (docs/openai.md).

It runs on the gateway's event loop beside the gRPC server and calls the same
code: the servicer's prompt codec, adapter resolver and `run_entries` (one
compute token stream per choice). `app` builds the ASGI app and the embedded
server, `routes` the handlers, `schemas` checks request bodies, `streams`
turns GenerateResponse messages into OpenAI responses and server-sent events,
`errors` maps domain errors to HTTP statuses and OpenAI error bodies.
"""
