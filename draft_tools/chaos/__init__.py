"""Fault injection around the runtime: a lossy proxy (``proxy``), hostile clients (``rogue``), and a
draft server whose drafter is slowed at random (``slow_drafter``, run by ``python -m
draft_tools.chaos.serve``). None of it lives in the runtime's own code paths."""
