"""Small helpers every layer shares: atomic files, dtype names."""
