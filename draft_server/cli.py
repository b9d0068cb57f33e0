"""`draft-server` command line: serve, make-tiny, keygen, quantize.

`serve` takes every ServerConfig field as a flag (see `draft-server serve --help`) or from a
TOML file (`--config FILE`, keys as in ServerConfig, optionally under a [server] table). The
model is loaded and checked before the socket binds, so a bad checkpoint fails with one line.
Every operator error (bad config, port in use, no GPU, missing torch) is one line on stderr
naming the culprit, and exit code 2.
"""

from __future__ import annotations

import argparse
import os
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
    """NAME.key (public, 0644) and NAME.key_secret (0600) in DIR, created if missing; an
    existing pair is never overwritten without --force."""
    import zmq.auth

    public = os.path.join(args.dir, f"{args.name}.key")
    secret = public + "_secret"
    existing = [p for p in (public, secret) if os.path.exists(p)]
    if existing and not args.force:
        print(f"draft-server: keygen: {existing[-1]} exists; pass --force to replace it", file=sys.stderr)
        return 2
    old_umask = os.umask(0o077)  # the secret key is never readable by others, not even for a moment
    try:
        os.makedirs(args.dir, mode=0o700, exist_ok=True)
        for p in existing:
            os.unlink(p)
        public, secret = zmq.auth.create_certificates(args.dir, args.name)
    except OSError as e:
        print(f"draft-server: keygen: cannot write keys to {args.dir}: {e.strerror or e}", file=sys.stderr)
        return 2
    finally:
        os.umask(old_umask)
    os.chmod(secret, 0o600)
    os.chmod(public, 0o644)
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
    if argv[:1] == ["quantize"]:
        from draft_server.models.exl3.convert import quantize_main

        return quantize_main(argv[1:])
    parser = argparse.ArgumentParser(prog="draft-server", description="DSpark draft server over ZeroMQ")
    sub = parser.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser("serve", help="run the draft server", description="Run the draft server.")
    _serve_flags(serve)
    serve.set_defaults(func=_serve)
    sub.add_parser("make-tiny", help="write a tiny random DSpark checkpoint (see make-tiny --help)")
    sub.add_parser("quantize", help="quantize a BF16 draft checkpoint to EXL3 on a GPU (see quantize --help)")
    keygen = sub.add_parser("keygen", help="create a CurveZMQ key pair (NAME.key, NAME.key_secret)")
    keygen.add_argument("--dir", default=".", help="directory for the key files (created, mode 0700, if missing)")
    keygen.add_argument("--name", default="server", help="base name of the key files")
    keygen.add_argument("--force", action="store_true", help="replace an existing key pair of that name")
    keygen.set_defaults(func=_keygen)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
