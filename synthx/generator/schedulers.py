"""The SynthX noise schedulers: the DDPM training scheduler of a recipe and the sampling schedulers swapped in.

Schedulers are diffusers' own; a sampling scheduler is built from the training scheduler's config
(same betas, same ``prediction_type``), so a pipeline saved with one scheduler samples with another
without retraining.

Example::

    training = build_noise_scheduler(recipe.scheduler)
    pipeline.scheduler = sampling_scheduler("dpm_solver", training)
"""

from __future__ import annotations

from diffusers import DDIMScheduler, DDPMScheduler, DPMSolverMultistepScheduler, SchedulerMixin
from omegaconf import DictConfig

from synthx.conditions import SAMPLING_SCHEDULERS

SAMPLING_SCHEDULER_CLASSES: dict[str, type[SchedulerMixin]] = dict(
    zip(SAMPLING_SCHEDULERS, (DDPMScheduler, DDIMScheduler, DPMSolverMultistepScheduler), strict=True)
)


def build_noise_scheduler(config: DictConfig) -> DDPMScheduler:
    """The DDPM training scheduler of the recipe's ``scheduler`` section (``synthx.config.NoiseSchedulerConfig``)."""
    return DDPMScheduler(
        num_train_timesteps=int(config.num_train_timesteps),
        beta_schedule=str(config.beta_schedule),
        beta_start=float(config.beta_start),
        beta_end=float(config.beta_end),
        prediction_type=str(config.prediction_type),
        clip_sample=bool(config.clip_sample),
    )


def sampling_scheduler(name: str, training_scheduler: SchedulerMixin) -> SchedulerMixin:
    """A sampling scheduler built from the training scheduler's config (same betas, same prediction_type).

    Raises:
        ValueError: for a name that is not one of :data:`SAMPLING_SCHEDULERS`.
    """
    if name not in SAMPLING_SCHEDULER_CLASSES:
        raise ValueError(f"unknown sampling scheduler {name!r}; expected one of {', '.join(SAMPLING_SCHEDULERS)}")
    return SAMPLING_SCHEDULER_CLASSES[name].from_config(training_scheduler.config)
