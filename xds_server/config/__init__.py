"""inferlb's configuration: the model (:mod:`.model`) and loading it from YAML (:mod:`.load`)."""

from xds_server.config.load import ConfigError, load_config, parse_config
from xds_server.config.model import (
    CircuitBreakers,
    Config,
    EndpointConfig,
    EnvoySide,
    EnvoyTls,
    EtcdDiscovery,
    EtcdService,
    EtcdTls,
    FieldProblem,
    History,
    KubernetesDiscovery,
    KubernetesInferencePool,
    KubernetesService,
    Listen,
    Loop,
    OutlierDetection,
    ProfileStep,
    ServiceConfig,
    TlsConfig,
    cluster_name,
    split_hostport,
)

__all__ = [
    "CircuitBreakers", "Config", "ConfigError", "EndpointConfig", "EnvoySide", "EnvoyTls", "EtcdDiscovery",
    "EtcdService", "EtcdTls", "FieldProblem", "History", "KubernetesDiscovery", "KubernetesInferencePool",
    "KubernetesService", "Listen", "Loop", "OutlierDetection", "ProfileStep", "ServiceConfig", "TlsConfig",
    "cluster_name", "load_config", "parse_config", "split_hostport",
]
