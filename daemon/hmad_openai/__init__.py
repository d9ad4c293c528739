"""hmad-openai: an OpenAI-compatible HTTP gateway in front of hmad (``pip install 'hmad[openai]'``).

It speaks OpenAI's ``/v1/models``, ``/v1/chat/completions`` and ``/v1/completions`` (streaming as
server-sent events) and serves Prometheus ``/metrics``; every request goes to hmad through hmaclient's
AsyncClient, so the gateway holds no model and may run as another user than hmad. ``app.py`` has the
routes, ``schema.py`` what each request field becomes, ``errors.py`` the HTTP statuses, ``guards.py`` the
Host and Content-Type checks, ``deadlines.py`` the read deadlines on slow clients, ``cli.py`` the flags.
"""
