"""The one exception type users see for bad input: a clear message, never a deep stack trace."""


class BlockdraftError(ValueError):
    """Bad input caught before any work: a drafter that does not fit, a bad checkpoint,
    a prompt that is too long, an out-of-range sampling parameter."""
