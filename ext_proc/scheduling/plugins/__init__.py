"""The built-in per-request scheduling plugins, one module each (registered by
:mod:`ext_proc.scheduling.builtin`)."""
