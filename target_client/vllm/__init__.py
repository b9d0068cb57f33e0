"""vLLM integration: the general plugin (``plugin``) and the remote proposer (``proposer``).

Nothing here is imported by ``target_client`` itself: vLLM loads ``plugin:register`` through its
entry point and names ``proposer.RemoteDSparkProposer`` in the speculative config.
"""
