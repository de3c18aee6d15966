"""Burstable grants on the map: bursters stopped before a request is placed into the bytes they use above
their grants (``reclaim``), and a grant's limit checked and changed (``limits``). What bursters use above
their grants is counted on the ledger (``Ledger.reburst``: ``memory_burst``, taken from a GPU's free bytes).
Imports the records, the ledger and the lifecycle; nothing of the walk."""
