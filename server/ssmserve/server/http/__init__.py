"""The OpenAI-compatible HTTP API (``ssmserve-server --http HOST:PORT``).

It runs in the worker's process and drives the same path as gRPC's Generate (the
session manager's create, fork and close; ``Generations.start``, ``Generation.run`` and
its updates), with the same tokens and tenants. A session is a prefix cache: a request
whose prompt extends an earlier one continues from its state.

``door``          what the worker holds: listener, application and cache, started and stopped
``listener``      uvicorn on a socket bound at the worker's start; graceful stop
``app``           the FastAPI routes, the bearer token, the bounds, error JSON
``completions``   prompts (text, ids, chat) -> ids; updates -> OpenAI's answers and events
``chat_template`` the model's chat template, rendered as transformers renders it
``params``        OpenAI's request fields -> ``GenerateRequest``
``runs``          a completion's session (new, continued, forked) and its generation
``prefix_cache``  the kept sessions per tenant and model, found by token prefix
``protocol``      the request models and the JSON of the answers
``errors``        refusals in OpenAI's error shape, typed errors mapped to HTTP statuses
"""
