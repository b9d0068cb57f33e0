"""Tools around the runtime: soak and chaos, benchmarks, the demo, the tiny trained pair.

They use ``draft_server``, ``target_client`` and ``protocol``; the runtime never imports them.
"""
