"""Stand-in: one micro-batch only."""


def dbo_current_ubatch_id() -> int:
    return 0
