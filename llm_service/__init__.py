"""Language-model runtime: loads only the language model, continuous-batching engine, paged KV
cache, prefill with injected embeddings and explicit positions. Ray-free and pydantic-free
(DESIGN.md): `deployments/` wraps it."""
