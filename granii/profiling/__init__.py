"""Profiling harness: graph generators and the training corpus for the per-primitive cost models."""
