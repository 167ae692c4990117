"""Speculative decoding: verification, proposers, the loop over sequence states."""
