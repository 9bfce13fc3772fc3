"""Small shared helpers: error types, torch helpers."""
