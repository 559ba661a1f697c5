"""The OpenAI faces: Chat Completions and Completions (`api` their shapes, `routes` their handlers) and the Responses
API (`responses`, `responses_routes`). Upstreams are asked in `api`'s shapes too."""
