"""Reusable builders for tests: tiny tokenizers and models made on the fly."""
