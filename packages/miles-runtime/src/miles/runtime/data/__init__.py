"""Prompt data: reading rows (JSONL, Parquet, hub datasets) and checking them before launch."""
