"""A real vLLM (CPU build) for the realvllm test tier: install.sh sets it up, launcher.py runs it."""
