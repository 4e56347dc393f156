"""`darkroom web`: the operator's page (Starlette + Jinja2 on uvicorn, server-rendered).

It reads the Redis and PostgreSQL the workers use and serves renditions from storage. Pages
are open to whoever reaches the port; every action (replay, retry, restore an original)
needs the operator token (auth.py). Without a token the page is read-only, and a
non-loopback host without a token refuses to start. Nothing imports this package but cli.
"""

from darkroom.operate.web.server import cmd_web, create_app

__all__ = ["cmd_web", "create_app"]
