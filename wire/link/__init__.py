"""The one socket-owner link loop both ends use, its peers and pending requests, the worker lanes
replies and handlers run on, and frames parked per key.

May import the rest of :mod:`gpumgr.wire` only.
"""
