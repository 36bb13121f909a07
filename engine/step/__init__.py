"""One step, top to bottom: step_engine.py orchestrates; engine_config.py and staging.py (checks,
arrays and drafts) prepare it, static_buffers.py holds what it stages; lm_head.py's head (or
kernel_head.py's) runs the step of a bucket; step_output.py (with prompt_logprobs.py) turns its
buffers into a StepOutput; engine_config.py's checkpoint undoes it. batch.py (PersistentBatch) and seq_front.py (the
table behind `step(hidden, seqs)`) drive it from the host's request table. The batch-invariance
probe the LM head uses is engine/invariance.py."""
