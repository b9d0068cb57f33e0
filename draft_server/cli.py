"""`draft-server` command line: serve, make-tiny, keygen.

`serve` takes every ServerConfig field as a flag (see `draft-server serve --help`) or from a
TOML file (`--config FILE`, keys as in ServerConfig, optionally under a [server] table). The
model is loaded and checked before the socket binds, so a bad checkpoint fails with one line.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from draft_server.config import add_flags, from_args


def _serve(args: argparse.Namespace) -> int:
    from draft_server.server import DraftServer, build_drafter

    try:
        cfg = from_args(args)
    except (ValueError, OSError) as e:
        print(f"draft-server: config error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        drafter = build_drafter(cfg)
    except (ValueError, OSError) as e:
        print(f"draft-server: cannot load the drafter: {e}", file=sys.stderr)
        return 2
    if cfg.drafter != "checksum":  # a model: its first steps after a (re)start must not miss their budgets
        from draft_server.engine import warm_up

        w = warm_up(drafter, cfg.max_batch_sessions, cfg.prefill_chunk_rows)
        logging.getLogger("draft_server").info(
            "warm-up: batches up to %d sessions and one prefill chunk in %.2f s", w["largest_batch"], w["seconds"]
        )
    server = DraftServer(cfg, drafter)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    server.start()
    # one parseable line for supervisors and tests
    port = server.http.port if server.http else -1
    print(f"READY endpoint={server.endpoint} metrics_port={port} epoch={server.epoch}", flush=True)
    while not stop.wait(0.5):
        pass
    server.stop()
    return 0


def _keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _make_tiny(argv: list[str]) -> int:
    from draft_server.models.tiny import main as tiny_main

    return tiny_main(argv)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny"]:
        return _make_tiny(argv[1:])
    parser = argparse.ArgumentParser(prog="draft-server", description="DSpark draft server over ZeroMQ")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the draft server", description="Run the draft server.")
    serve.add_argument("--config", help="TOML file with server settings (flags override it)")
    add_flags(serve)
    serve.set_defaults(func=_serve)
    sub.add_parser("make-tiny", help="write a tiny random DSpark checkpoint (see make-tiny --help)")
    keygen = sub.add_parser("keygen", help="create a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    keygen.add_argument("--dir", default=".", help="directory for the key files")
    keygen.add_argument("--name", default="server", help="base name of the key files")
    keygen.set_defaults(func=_keygen)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
