"""Request state, paged KV cache, sampling, stopping and the step scheduler."""
