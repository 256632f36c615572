"""Factor plugins (weight multipliers: capacity, slow start, balance), one per module; see :mod:`..registry`."""
