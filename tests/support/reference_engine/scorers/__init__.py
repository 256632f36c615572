"""Scorer plugins (score in [0, 1], 1 = best), one per module; listed in :mod:`..builtin`."""
