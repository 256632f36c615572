"""Filter plugins, one per module; each module's ``PLUGIN`` is registered in :mod:`..registry`."""
