"""Inference speed of dense and compressed models."""
