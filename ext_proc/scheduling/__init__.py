"""The per-request scheduler as a plugin pipeline: filters -> weighted scorers -> one picker, per
named scheduling profile (docs/picker.md, "The scheduling pipeline").

- :mod:`.api`: the request context (:class:`Request`), the plugin protocols and a picker's
  :class:`Choice`;
- :mod:`.registry`: plugins by name (:func:`register`: the built-ins, and any module named in
  ``picker.plugin_modules``);
- :mod:`.profile`: a profile's steps ``{plugin, weight, params}`` -> :class:`Profile`;
- :mod:`.plugins`: the built-ins, one module each (:mod:`.builtin` registers them);
- :mod:`.affinity`: the two session-affinity contracts (``strict``, ``soft``) a service names.
"""

from ext_proc.scheduling import builtin as _builtin  # noqa: F401  (registers the built-ins)
from ext_proc.scheduling.api import (
    OUTCOMES,
    SCAN_MAX,
    Choice,
    Filter,
    Floor,
    LoadPerShare,
    NoParams,
    Picker,
    PluginParams,
    Request,
    Score,
    Scorer,
    Without,
    spin,
)
from ext_proc.scheduling.profile import DEFAULT_STEPS, Profile, ProfileError, Step, build_profile, default_profile
from ext_proc.scheduling.registry import REGISTRY, import_plugins, register

__all__ = [
    "DEFAULT_STEPS", "OUTCOMES", "REGISTRY", "SCAN_MAX", "Choice", "Filter", "Floor", "LoadPerShare", "NoParams",
    "Picker", "PluginParams", "Profile", "ProfileError", "Request", "Score", "Scorer", "Step", "Without",
    "build_profile", "default_profile", "import_plugins", "register", "spin",
]
