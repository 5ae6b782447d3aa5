"""How many Ray actors a run starts and what each one reserves (GPUs, CPUs).

A tqpipe worker holds one loaded model and decodes one document at a time;
on a GPU node the model and its cache want a whole GPU, and two actors on
one GPU would only split its memory.  So, by default:

* the cluster has GPUs: one actor per GPU, each reserving ``num_gpus=1``
  (Ray then sets ``CUDA_VISIBLE_DEVICES`` to that GPU, so MLX sees exactly
  it);
* more ``workers`` asked for than there are GPUs: the extra actors are CPU
  actors (``num_gpus=0``, MLX pinned to the CPU) on whatever CPUs are left;
* no GPUs: CPU actors only, ``workers`` of them (the job's default 2).

``gpus_per_worker`` (the job's ``engine:`` block) overrides the share: 0
forces CPU actors everywhere, 0.5 puts two actors on each GPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_CPU_WORKERS = 2


@dataclass(frozen=True)
class ActorPlan:
    """``gpu_actors`` actors reserving ``num_gpus`` each, then ``cpu_actors`` CPU-only ones.

    ``pin``: the cluster has GPUs, so every actor pins MLX to its device (a
    CPU actor there must not touch a GPU another actor reserved); on a
    cluster without GPU resources actors keep MLX's default device (a Mac's
    Metal GPU is no Ray resource).
    """

    gpu_actors: int
    cpu_actors: int
    num_gpus: float
    num_cpus: float
    pin: bool = False

    @property
    def workers(self) -> int:
        return self.gpu_actors + self.cpu_actors

    def device(self, index: int) -> str | None:
        """``"gpu"`` or ``"cpu"``: where actor ``index`` runs MLX (None: MLX's default)."""
        if not self.pin:
            return None
        return "gpu" if index < self.gpu_actors else "cpu"

    def resources(self, index: int) -> dict:
        """The ``ray.remote(...)`` resource options of actor ``index``."""
        gpus = self.num_gpus if index < self.gpu_actors else 0
        return {"num_cpus": self.num_cpus, "num_gpus": gpus}

    def describe(self) -> str:
        parts = []
        if self.gpu_actors:
            parts.append(f"{self.gpu_actors} GPU actor{'s' * (self.gpu_actors != 1)} ({self.num_gpus:g} GPU each)")
        if self.cpu_actors:
            parts.append(f"{self.cpu_actors} CPU actor{'s' * (self.cpu_actors != 1)}")
        return " + ".join(parts) or "no actors"


def plan_actors(cluster_gpus: float, workers: int | None, gpus_per_worker: float | None,
                num_cpus: float = 1.0) -> ActorPlan:
    """The actors for a cluster with ``cluster_gpus`` GPUs (see the module docstring).

    ``workers`` None: one actor per GPU share (``DEFAULT_CPU_WORKERS`` CPU
    actors on a cluster without GPUs).
    """
    if gpus_per_worker is not None and gpus_per_worker < 0:
        raise ValueError(f"gpus_per_worker must be >= 0, got {gpus_per_worker}")
    if workers is not None and workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    share = 1.0 if gpus_per_worker is None else float(gpus_per_worker)
    slots = int(math.floor(cluster_gpus / share + 1e-9)) if share > 0 else 0
    if slots == 0:
        if share > 0 and gpus_per_worker is not None:
            raise ValueError(f"gpus_per_worker={gpus_per_worker:g} but the cluster has {cluster_gpus:g} GPUs")
        return ActorPlan(0, workers or DEFAULT_CPU_WORKERS, 0.0, num_cpus, pin=cluster_gpus > 0)
    n = slots if workers is None else workers
    gpu_actors = min(n, slots)
    return ActorPlan(gpu_actors, n - gpu_actors, share, num_cpus, pin=True)


def local_gpus() -> int:
    """NVIDIA GPUs this machine offers a private Ray instance (as Ray counts them:
    ``CUDA_VISIBLE_DEVICES`` when set, else ``nvidia-smi -L``)."""
    import os
    import subprocess

    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return len([d for d in env.split(",") if d.strip() and d.strip() != "-1"])
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def pin_device(device: str) -> None:
    """Make MLX in this process use ``device`` ("gpu"/"cpu") by default (an actor's first act)."""
    import mlx.core as mx

    mx.set_default_device(mx.gpu if device == "gpu" else mx.cpu)
