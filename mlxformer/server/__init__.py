"""The HTTP server: OpenAI, Anthropic and Ollama APIs over one batching ``Engine``.

- The app: ``app.py`` (the FastAPI app, ``create_app``), ``context.py`` (what routers share),
  ``guards.py`` (Host allow-list, body limit), ``errors.py`` (OpenAI-shaped errors),
  ``openapi.py``, ``runner.py`` (uvicorn, foreground or ``ServerThread``), ``metrics.py``
  (``/metrics``), ``heap.py`` (glibc heap growth bounded), ``static/`` (the chat page).
- OpenAI Chat Completions and Completions: ``protocol.py`` (pydantic schemas), ``translate.py``
  (request to engine request), ``prepare.py`` (checks, template, tokens, grammar: off the
  loop), ``openai_routes.py``, ``chat_turn.py`` (a chat request as a ``Turn``),
  ``chat_output.py`` (whole responses, SSE chunks, usage, logprobs), ``hooks.py``
  (``response_format``), ``tools.py`` (tool calling).
- Streams: ``streaming.py`` (a request held by one HTTP response), ``sse.py`` (every stream's
  loop, keep-alive pings).
- Agent APIs: ``turn.py`` (one API-neutral turn to an engine request), ``reply.py`` +
  ``segments.py`` (engine events to reasoning, content and call deltas), ``reasoning.py``,
  ``toolcalls/`` (one module per call format), ``anthropic_api.py`` +
  ``anthropic_protocol.py``, ``responses_api.py`` + ``responses_protocol.py`` +
  ``responses_state.py`` (the Responses API), ``meta_api.py`` (models, tokenize, templates,
  adapters), ``hosting.py`` (the one model-name rule).
- ``embeddings_api.py``: ``/v1/embeddings``, ``/v1/rerank``, Ollama's ``/api/embed``.
- Ollama's API: ``ollama_api.py`` + ``ollama_protocol.py``.
- Several models: ``registry.py`` (``ModelHost``, ``SingleHost``), ``hosts.py`` (``MultiHost``:
  loaded on first use, least recently used out), ``multi_app.py`` (the front app),
  ``model_facts.py`` (what is known of a model before loading it)."""
