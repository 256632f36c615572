"""Filter plugins, one per module; each module's ``PLUGIN`` is listed in :mod:`..builtin`."""
