"""Other frameworks' checkpoints: Hugging Face Llama/Mistral/Mixtral import and export (hf.py,
with the config translation and tensor map in hf_layout.py)."""
