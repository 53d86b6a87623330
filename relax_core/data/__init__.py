"""Prompts in: dataset loading, multimodal inputs, generated tasks."""
