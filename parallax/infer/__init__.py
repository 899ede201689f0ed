"""Using a trained checkpoint: KV-cache decoding (decode.py), `parallax sample` (sample.py) and
`parallax eval` (evaluate.py)."""
