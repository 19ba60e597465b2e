"""Repository tools (not installed): generators for the documentation."""
