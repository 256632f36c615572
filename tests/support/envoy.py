"""Reading Envoy's admin API in tests."""

from __future__ import annotations

from inferlb.devstack.envoy_admin import admin_get


def envoy_stat(admin: str, name: str) -> int | None:
    """The value of one counter or gauge (exact name), or None when Envoy has no such stat."""
    text = admin_get(admin, f"/stats?filter=^{name}$").decode()
    for line in text.splitlines():
        key, _, value = line.partition(": ")
        if key == name:
            return int(value)
    return None
