"""Factor plugins (weight multipliers: capacity, slow start, balance), one per module; listed in :mod:`..builtin`."""
