"""Settings from CLI flags, ``GPUMGR_*`` environment variables and a YAML file, in that order of precedence."""

from __future__ import annotations

from typing import Any, TypeVar

from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict, YamlConfigSettingsSource

from gpumgr.wire.units import parse_bytes

S = TypeVar("S", bound="Settings")


class Settings(BaseSettings):
    """Base of the manager's and the agent's settings; fields are read from all three sources."""

    model_config = SettingsConfigDict(env_prefix="GPUMGR_", extra="forbid", yaml_file=None)

    @classmethod
    def settings_customise_sources(cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
                                   env_settings: PydanticBaseSettingsSource, *_: Any, **__: Any,
                                   ) -> tuple[PydanticBaseSettingsSource, ...]:
        """Flags beat the environment, which beats the YAML file."""
        return init_settings, env_settings, YamlConfigSettingsSource(settings_cls)


def load_settings(cls: type[S], path: str | None = None, **overrides: Any) -> S:
    """Build ``cls`` from ``path`` (YAML, optional), the environment and the non-None ``overrides``."""
    if path is None:
        return cls(**_given(overrides))
    config = SettingsConfigDict(**{**cls.model_config, "yaml_file": path})
    configured: type[S] = type(cls.__name__, (cls,), {"model_config": config})
    return configured(**_given(overrides))


def size(value: Any) -> int:
    """Validator for byte sizes written as ``512MiB`` or plain integers; zero is allowed here."""
    return 0 if value in (0, "0") else parse_bytes(value)


def split_hostport(value: str, default_port: int) -> tuple[str, int]:
    """``'0.0.0.0:9400'`` → ``('0.0.0.0', 9400)``; a bare host keeps ``default_port``."""
    host, sep, port = value.rpartition(":")
    if not sep:
        return value, default_port
    if not port.isdigit():
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]") or "127.0.0.1", int(port)


def _given(overrides: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in overrides.items() if v is not None}
