"""Thin client for the target engine: DraftClient and the vLLM plugin. Imports protocol only."""
