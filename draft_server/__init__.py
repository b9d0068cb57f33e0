"""Draft server: ZeroMQ front end, scheduler, sessions, model backends, metrics, CLI."""
