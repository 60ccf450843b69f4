"""The OpenAI-compatible HTTP server over the serving engine (`meshlm serve`), split by concern: `protocol` (the
request bodies and errors), `constraints` (OpenAI's constraint fields), `openai_format` (the answers' shapes),
`metrics` (Prometheus), `state` (what the handlers share), `rows` (a request's rows in the engine), `handlers`
(the routes) and `app` (the app and its life: `create_app`, `bind`, `serve`)."""
