"""Precision: weight-only quantization, and the accuracy check that measures what it costs."""
