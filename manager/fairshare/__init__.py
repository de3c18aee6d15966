"""Fair share across accounts: the arithmetic of shares and the rule that says when reclaim may move room.

Pure functions of numbers and the account tree: no records, no lock, no I/O (the model applies them).
"""
