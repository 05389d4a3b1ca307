"""drafters."""
