"""Typed, validated run configuration.

A run is described by one YAML file (see ``configs/demo.yaml``) plus dotted command-line
overrides (``--set loss.base.margin=0.3``). Pure data: importing it imports no torch, Ray,
DeepSpeed or open_clip, and registers nothing. Everything is validated on the driver, before Ray
starts: unknown keys and bad values are all reported at once, each with its dotted path.

:mod:`.schema` holds the sections and :class:`RunConfig`; :mod:`.fields` their building blocks
(strict numbers, locations, :class:`Section`, :class:`ConfigError`); :mod:`.components` the parts
chosen by name (base losses, structures, teachers, fusions) and their parameters; :mod:`.tree` dotted keys over plain trees;
:mod:`.loading` YAML files and overrides layered into a :class:`RunConfig`.
"""

from pairsim.config.fields import (Bool, ConfigError, Float, Int, PathOrUri, Section, check_tracking_uri, format_errors,
                                   registered)
from pairsim.config.loading import apply_overrides, layer, load_config, read_yaml, yaml_value
from pairsim.config.components import (BASE_LOSSES, FUSIONS, STRUCTURES, TEACHERS, BaseLossParams, Choosing, Family,
                                       StructureParams, TeacherParams, TemperatureConfig)
from pairsim.config.schema import (DEEPSPEED_OWNED_KEYS, LABEL, LOCAL_PATH_KEYS, CUSAConfig, DataConfig, EvalConfig,
                                   LossConfig, ModelConfig, NodeRolesConfig, OptimConfig, RayConfig, RunConfig,
                                   TrackingConfig, TrainConfig, absolute_paths, validate)
from pairsim.config.tree import MISSING, flatten, get_dotted, merge, set_dotted

__all__ = ["Bool", "ConfigError", "Float", "Int", "PathOrUri", "Section", "format_errors", "registered",
           "apply_overrides", "layer", "load_config", "read_yaml", "yaml_value", "BASE_LOSSES", "FUSIONS", "STRUCTURES",
           "TEACHERS", "BaseLossParams", "Choosing", "Family", "StructureParams", "TeacherParams", "TemperatureConfig",
           "DEEPSPEED_OWNED_KEYS", "LABEL", "LOCAL_PATH_KEYS", "CUSAConfig", "DataConfig", "EvalConfig", "LossConfig",
           "ModelConfig", "NodeRolesConfig", "OptimConfig", "RayConfig", "RunConfig", "TrackingConfig", "TrainConfig",
           "absolute_paths", "check_tracking_uri", "validate", "MISSING", "flatten", "get_dotted", "merge",
           "set_dotted"]
