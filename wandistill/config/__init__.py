"""Typed recipes: strict TOML loading into pydantic dataclasses, with `--set` overrides.

One recipe drives both stages (`[precompute.*]` and `[train.*]` sections), the way torchtitan's job
config does. Loading is strict, through pydantic like every other file wandistill reads: an unknown
key is an error naming the closest valid key, and a value of the wrong type or out of its declared
range is an error naming the key, the value and the type or range it needs. Overrides
(`--set precompute.sampler.num_inference_steps=4`, or `sampler.num_inference_steps=4` inside a
stage command) are applied to the raw TOML before validation, so they are checked the same way.

The package: `common` (what the sections share: the `section` pydantic dataclass and its
errors), `precompute` and `train` (each stage's sections, one class per recipe table), `recipe`
(the loader, `--set` and the shipped recipes). Callers import from `wandistill.config`.
"""

from wandistill.config.common import BACKENDS, DTYPES
from wandistill.config.precompute import (
    CacheConfig,
    PrecomputeConfig,
    SamplerConfig,
    TeacherConfig,
)
from wandistill.config.recipe import (
    MAX_RECIPE_BYTES,
    RECIPES_PACKAGE,
    Recipe,
    apply_override,
    from_dict,
    is_recipe_path,
    load_recipe,
    resolve_recipe,
    shipped_recipe,
    shipped_recipe_names,
    shipped_recipes_dir,
    to_dict,
)
from wandistill.config.train import (
    LORA_TARGETS,
    PARALLEL,
    FsdpConfig,
    LossConfig,
    OptimConfig,
    StudentConfig,
    StudentLoraConfig,
    TeacherInitConfig,
    TrainConfig,
)

__all__ = [
    "BACKENDS",
    "DTYPES",
    "LORA_TARGETS",
    "MAX_RECIPE_BYTES",
    "PARALLEL",
    "RECIPES_PACKAGE",
    "CacheConfig",
    "FsdpConfig",
    "LossConfig",
    "OptimConfig",
    "PrecomputeConfig",
    "Recipe",
    "SamplerConfig",
    "StudentConfig",
    "StudentLoraConfig",
    "TeacherConfig",
    "TeacherInitConfig",
    "TrainConfig",
    "apply_override",
    "from_dict",
    "is_recipe_path",
    "load_recipe",
    "resolve_recipe",
    "shipped_recipe",
    "shipped_recipe_names",
    "shipped_recipes_dir",
    "to_dict",
]
