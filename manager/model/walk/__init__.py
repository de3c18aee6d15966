"""The queue's walk: placing waiting requests as room frees (``dispatch``), and with accounts the fair walk and
reclaim (``sharing``). Called under the ledger's lock, like the rest of the model."""
