"""One step: config, the captured body over the static buffers, the orchestrator, outputs, prompt logprobs."""
