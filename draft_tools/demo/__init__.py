"""`make demo`: remote drafts inside vLLM (``part_vllm``), then many engines against one server (``part_load``)."""
