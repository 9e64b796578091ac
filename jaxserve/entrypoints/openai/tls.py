"""TLS for the server: the context built from --ssl-* flags and, with --enable-ssl-refresh, its
reloading when the key or certificate files change.

Where it sits: used once by api_server.run_server, before the model loads (a bad certificate
should fail at once), and as an app cleanup context for the refresh loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
import ssl

from aiohttp import web

from jaxserve.entrypoints.openai.server_args import ServerArgs

logger = logging.getLogger("jaxserve.entrypoints.openai.api_server")


def ssl_context(args: ServerArgs) -> ssl.SSLContext | None:
    if not args.ssl_certfile:
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    if args.ssl_ca_certs:
        ctx.load_verify_locations(args.ssl_ca_certs)
    ctx.verify_mode = ssl.VerifyMode(args.ssl_cert_reqs)
    return ctx


def ssl_refresher(ctx: ssl.SSLContext, args: ServerArgs, interval: float = 5.0):
    """--enable-ssl-refresh: load the key and certificates again when their files change;
    connections made after that use them."""
    paths = [p for p in (args.ssl_keyfile, args.ssl_certfile, args.ssl_ca_certs) if p]

    def stamp() -> tuple:
        return tuple(os.stat(p).st_mtime_ns if os.path.exists(p) else 0 for p in paths)

    async def refresh(app: web.Application):
        async def loop():
            seen = stamp()
            while True:
                await asyncio.sleep(interval)
                current = stamp()
                if current != seen:
                    seen = current
                    try:
                        ctx.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
                        if args.ssl_ca_certs:
                            ctx.load_verify_locations(args.ssl_ca_certs)
                        logger.info("Reloaded the TLS certificates")
                    except (OSError, ssl.SSLError) as e:
                        logger.error("Could not reload the TLS certificates: %s", e)

        task = asyncio.create_task(loop())
        yield
        task.cancel()

    return refresh
