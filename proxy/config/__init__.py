"""The one validated configuration model, loaded from one YAML file; every default.

The model is split by section (settings.py: the proxy and its backends; calls.py: how calls to a
backend go; launch.py: how `up` starts its servers; stores.py: the files on disk;
endpoint_urls.py: an endpoint URL's form and its credentials; endpoint_hosts.py: the hosts an
admin may add; run_keys.py: scoring keys limited to some runs; strict.py: the base of every model). Import from
here: `from proxy.config import Settings, load_settings`.
"""

from proxy.config.calls import AdmissionConfig, CircuitConfig, ReaskConfig, RetryConfig, RoutingConfig
from proxy.config.cascades import CascadeConfig, CascadeStage
from proxy.config.endpoint_hosts import EndpointHost, check_endpoint_host
from proxy.config.endpoint_urls import ENDPOINT_URL_PATTERN, endpoint_url, split_credentials
from proxy.config.launch import LaunchConfig, ReplicaLaunch, connect_host, is_loopback
from proxy.config.loading import load_settings, read_config, settings_from_dict
from proxy.config.quality import PROBE_KINDS, ProbesConfig, QualityAlarmConfig, QualityConfig, QualityRestoreConfig
from proxy.config.run_keys import RunKeyConfig, RunScope
from proxy.config.settings import BackendConfig, FramesConfig, ProxySettings, SamplingConfig, Settings
from proxy.config.stores import AuditConfig, FrameStoreConfig, ReferenceStoreConfig
from proxy.errors import ConfigError

__all__ = [
    "CascadeConfig",
    "CascadeStage",
    "ENDPOINT_URL_PATTERN",
    "AdmissionConfig",
    "AuditConfig",
    "BackendConfig",
    "CircuitConfig",
    "ConfigError",
    "EndpointHost",
    "FrameStoreConfig",
    "FramesConfig",
    "LaunchConfig",
    "PROBE_KINDS",
    "ProbesConfig",
    "ProxySettings",
    "QualityAlarmConfig",
    "QualityConfig",
    "QualityRestoreConfig",
    "ReaskConfig",
    "ReferenceStoreConfig",
    "ReplicaLaunch",
    "RetryConfig",
    "RoutingConfig",
    "RunKeyConfig",
    "RunScope",
    "SamplingConfig",
    "Settings",
    "check_endpoint_host",
    "connect_host",
    "endpoint_url",
    "split_credentials",
    "is_loopback",
    "load_settings",
    "read_config",
    "settings_from_dict",
]
