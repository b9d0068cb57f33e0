"""`draft-server` command line: serve, make-tiny, keygen.

`serve` takes every ServerConfig field as a flag (see `draft-server serve --help`) or from a
TOML file (`--config FILE`, keys as in ServerConfig, optionally under a [server] table). The
model is loaded and checked before the socket binds, so a bad checkpoint fails with one line.
"""

from __future__ import annotations

import argparse
import sys

from draft_server.config import ServerConfig, add_flags, from_args


def parse_serve_config(args: argparse.Namespace) -> ServerConfig | None:
    """The validated config, or None after printing one line (exit code 2 for the caller)."""
    try:
        return from_args(args)
    except (ValueError, OSError) as e:
        print(f"draft-server: config error: {e}", file=sys.stderr)
        return None


def _serve(args: argparse.Namespace) -> int:
    from draft_server.app import serve

    cfg = parse_serve_config(args)
    return 2 if cfg is None else serve(cfg)


def _keygen(args: argparse.Namespace) -> int:
    import zmq.auth

    public, secret = zmq.auth.create_certificates(args.dir, args.name)
    print(f"public key: {public}\nsecret key: {secret}")
    return 0


def _make_tiny(argv: list[str]) -> int:
    from draft_server.models.tiny import main as tiny_main

    return tiny_main(argv)


def serve_parser(prog: str = "draft-server serve") -> argparse.ArgumentParser:
    serve = argparse.ArgumentParser(prog=prog, description="Run the draft server.")
    _serve_flags(serve)
    return serve


def _serve_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", help="TOML file with server settings (flags override it)")
    add_flags(parser)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["make-tiny"]:
        return _make_tiny(argv[1:])
    parser = argparse.ArgumentParser(prog="draft-server", description="DSpark draft server over ZeroMQ")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the draft server", description="Run the draft server.")
    _serve_flags(serve)
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
