"""Verifiable task families and their reward functions."""
