"""`draft-soak`: synthetic target engines against a draft server under chaos, with strict invariants.

``cli`` (the command), ``run`` (one pass), ``supervisor`` (the server process), ``engine`` (one
synthetic engine process), ``report`` (invariants, forensics, plots).
"""
