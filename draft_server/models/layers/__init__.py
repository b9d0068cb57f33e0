"""The attention variants of the DSpark backbone (``mla``: Kimi-K3, ``gqa``: Qwen3) and the small
ops both use (``ops``)."""
