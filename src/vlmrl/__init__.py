"""vlmrl."""
