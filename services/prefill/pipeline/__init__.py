"""Chunked pipeline-parallel prefill (issue 21): a prefill group of stages, each computing a
range of the model's layers; stage 0 leads. See docs and `design21` for the picture."""
