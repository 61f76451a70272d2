"""Model families by `config.json` model_type."""

from __future__ import annotations

from rlt_serve.config import ConfigError, ModelConfig
from rlt_serve.models.base import LoopedModel
from rlt_serve.models.huginn import HuginnForCausalLM
from rlt_serve.models.nanbeige import NanbeigeForCausalLM
from rlt_serve.models.ouro import OuroForCausalLM

MODEL_REGISTRY: dict[str, type[LoopedModel]] = {
    "ouro": OuroForCausalLM,
    "nanbeige": NanbeigeForCausalLM,
    "huginn_raven": HuginnForCausalLM,
}


def get_model_class(cfg: ModelConfig) -> type[LoopedModel]:
    try:
        return MODEL_REGISTRY[cfg.model_type]
    except KeyError:
        raise ConfigError(f"no implementation for model_type {cfg.model_type!r}") from None
