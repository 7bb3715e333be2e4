"""Model definitions and weight loading (Llama family)."""
