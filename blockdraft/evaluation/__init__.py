"""Evaluation: the bench, bench-serve, tau by replay, prompt sets and plots."""
