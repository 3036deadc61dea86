"""Ray Serve layer: app builder, router/ingress, encoder and LLM deployment wrappers."""
