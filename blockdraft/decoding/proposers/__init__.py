"""Proposers, side by side: what one decode step asks the target to verify, a module each (as
vLLM's spec_decode keeps a file per method), over one request's settings and policies
(`request.Proposers`):

- `lookup`: prompt lookup, the continuation of an earlier occurrence of the context's last n-gram,
  no forward at all, verified where its own adaptive policy expects it to pay;
- `chain`: the drafter's chain, one block-diffusion forward, one token per block position;
- `tree`: the drafter's tree, the same forward, several candidates per position, the lookup
  continuation as one more branch, its node budget chosen from the measured cost of verifying n
  tokens (down to a plain step).

Each returns a `Proposal` (a draft: tree.py's `Tree`); where the drafter must run, the step first
collects what every sequence asks of it (`DraftWanted`) and runs one draft forward for all
(`drafter.draft_blocks`). engine.py's `propose` chooses among them per sequence.
"""

from .drafter import draft_blocks
from .proposal import DraftWanted, Proposal
from .request import LOOKUP_BLOCK, Proposers

__all__ = ["LOOKUP_BLOCK", "DraftWanted", "Proposal", "Proposers", "draft_blocks"]
