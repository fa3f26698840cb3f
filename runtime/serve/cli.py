"""``boardtalk serve``: parse options, merge them over the config file, run the service."""
from __future__ import annotations

import argparse
import logging
import os


def _host_port(s: str) -> tuple[str, int]:
    """HOST:PORT, [IPv6]:PORT or :PORT (loopback)."""
    host, sep, port = s.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT with a port from 0 to 65535, got {s!r}")
    host = host.strip("[]") or "127.0.0.1"
    return host, int(port)


def add_commands(sub) -> None:
    from runtime.cli import _path, run_options

    from .config import DEFAULT_PATH

    sp = sub.add_parser(
        "serve", help="run the board service: voice loop, OpenAI-compatible HTTP API, Wyoming",
        description="Load the artifact once, prefill the system prompt, then serve what the config enables: the voice "
                    "loop on the board's microphone and speaker, the OpenAI-compatible HTTP API and the Wyoming "
                    "server; one model serves one stream at a time (voice turns first). Flags override the config "
                    "file. SIGTERM stops within about 2 s; SIGHUP reloads the config. See docs/service.md.")
    sp.add_argument("--config", metavar="FILE", type=_path,
                    help=f"YAML config (default: {DEFAULT_PATH} if it exists, else the built-in defaults; "
                         "'boardtalk serve --print-config' shows every key)")
    sp.add_argument("--print-config", action="store_true",
                    help="print the effective config (file + flags; the API key hidden) as YAML and exit (default: serve)")
    sp.add_argument("--api", metavar="HOST:PORT", type=_host_port,
                    help="HTTP API address (default: api.host:api.port of the config, 127.0.0.1:8080); "
                         "beyond loopback it requires an API key")
    sp.add_argument("--no-api", action="store_true", help="do not serve the HTTP API (default: serve it)")
    sp.add_argument("--api-key", metavar="KEY",
                    help="require 'Authorization: Bearer KEY' (default: $BOARDTALK_API_KEY if set and non-empty, else "
                         "api.api_key of the config, else none on loopback); visible in ps, so prefer the config file or the variable")
    sp.add_argument("--wyoming", metavar="HOST:PORT", type=_host_port,
                    help="serve Wyoming at this address (default: off unless wyoming.enabled; port 10700)")
    sp.add_argument("--no-audio", action="store_true",
                    help="no voice loop: API and Wyoming only (default: the voice loop runs when audio.enabled)")
    run_options(sp, gen=False)
    sp.set_defaults(func=cmd_serve)


def overrides(args) -> dict[str, dict]:
    """The config keys the command line sets (flags, and $BOARDTALK_API_KEY), by section; a SIGHUP reload
    applies them again over the reread file, so a key or address given as a flag survives the reload."""
    over: dict[str, dict] = {"model": {}, "api": {}, "wyoming": {}, "audio": {}}
    for key in ("artifact", "board", "threads", "max_context", "trusted_keys"):
        if getattr(args, key, None) is not None:
            over["model"][key] = getattr(args, key)
    if args.api:
        over["api"].update(host=args.api[0], port=args.api[1], enabled=True)
    if args.no_api:
        over["api"]["enabled"] = False
    # an empty variable counts as unset (a unit's 'Environment=BOARDTALK_API_KEY=' must not clear the file's key);
    # an empty --api-key is refused by the config check (api.api_key: expected a non-empty string)
    key = args.api_key if args.api_key is not None else (os.environ.get("BOARDTALK_API_KEY") or None)
    if key is not None:
        over["api"]["api_key"] = key
    if args.wyoming:
        over["wyoming"].update(host=args.wyoming[0], port=args.wyoming[1], enabled=True)
    if args.no_audio:
        over["audio"]["enabled"] = False
    return over


def effective_config(args):
    from .config import load_config, with_overrides

    return with_overrides(load_config(args.config), **overrides(args))


def raise_fd_limit(want: int = 65536) -> int:
    """Raise this process's soft open-files limit toward the hard one (systemd gives services 1024 soft, kept low
    for select(); asyncio uses epoll): a client opening connections runs out of its own ports (~28k per address)
    before the service runs out of descriptors. Returns the soft limit now."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as e:
            logging.getLogger(__name__).warning("could not raise the open-files limit from %d: %s", soft, e)
    return soft


def _loader(section):
    """ModelSection -> Model through the CLI's loader (it builds the default artifact on first use)."""
    from runtime.cli import _load

    ns = argparse.Namespace(artifact=section.artifact, board=section.board, threads=section.threads,
                            max_context=section.max_context, trusted_keys=section.trusted_keys)
    return _load(ns)


def cmd_serve(args) -> int:
    import asyncio

    from .config import DEFAULT_PATH, render
    from .service import Service

    cfg = effective_config(args)
    if args.print_config:
        print(render(cfg, redact=True), end="")
        return 0
    if not getattr(args, "verbose", 0):
        logging.getLogger().setLevel(cfg.service.log_level.upper())
    if cfg.api.enabled:
        try:
            import aiohttp  # noqa: F401
        except ImportError:
            raise ImportError("the HTTP API needs aiohttp: pip install 'boardtalk[serve]' (or run with --no-api)") \
                from None
    if cfg.api.enabled or cfg.wyoming.enabled:
        raise_fd_limit()
    path = args.config or (DEFAULT_PATH if DEFAULT_PATH.exists() else None)
    return asyncio.run(Service(cfg, _loader, config_path=path, overrides=overrides(args)).run())
