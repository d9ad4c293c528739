"""hmad-openai: an HTTP gateway in front of hmad (``pip install 'hmad[openai]'``), speaking the APIs apps use.

OpenAI's ``/v1/models``, ``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``, Anthropic's
``/v1/messages`` and Ollama's ``/api/*`` (``docs/gateway.md`` maps every field), streamed in each API's own
form, plus Prometheus ``/metrics``. Every request goes to hmad through hmaclient's AsyncClient, so the
gateway holds no model and may run as another user than hmad. ``app.py`` mounts each API's module of routes
(``openai_api``, ``responses_api``, ``anthropic_api``, ``ollama_api``) and owns the guards, authentication
and error pages; ``gateway.py`` what they share; ``schema.py`` what each OpenAI field becomes;
``errors.py`` the HTTP statuses; ``guards.py`` the Host and Content-Type checks; ``deadlines.py`` the read
deadlines on slow clients; ``cli.py`` the flags.
"""
