"""The OpenAI-compatible server: schemas (``protocol``), request translation (``translate``),
responses and SSE (``responses``), the FastAPI app (``app``), running it (``runner``) and the
chat page (``static/chat.html``)."""
