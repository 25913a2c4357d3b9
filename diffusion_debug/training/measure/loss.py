"""The loss as measured on the device: the optimizer step's loss added up over its micro-steps,
its sums per timestep bucket, and the non-finite values of the ``inputs=`` batch (given, or
counted already where it was seen: :class:`CountedInputs`)."""

from __future__ import annotations

import math
from typing import Any

import torch

from ...stats import to_device, walk_tensors

NO_LOSS: Any = type("NoLoss", (), {"__repr__": lambda self: "NO_LOSS"})()
"""The loss of a call that has none (``diffusion-debug launch``: a backward of outputs given their
gradients, a pipeline stage's): its gradients are measured and judged, no loss is recorded or judged
unless another call of the step gave one."""


def per_sample(per_sample_loss: Any, timesteps: Any) -> Any:
    """One loss a sample: the loss before reduction (``F.mse_loss(..., reduction="none")``,
    ``[batch, C, H, W]``), whose first dimension is the batch's ``timesteps``, is each sample's
    mean over the other dimensions, as diffusers' scripts reduce it; anything else as given (a
    vector, ``[batch, 1]``; a shape that fits no reading is named by the step's measurement)."""
    if not isinstance(per_sample_loss, torch.Tensor) or per_sample_loss.dim() < 2 or timesteps is None:
        return per_sample_loss
    samples = timesteps.numel() if isinstance(timesteps, torch.Tensor) else torch.as_tensor(timesteps).numel()
    if per_sample_loss.shape[0] != samples or per_sample_loss.numel() == samples:
        return per_sample_loss
    return per_sample_loss.detach().mean(dim=tuple(range(1, per_sample_loss.dim())))


class TimestepBuckets:
    """Loss per timestep bucket (``buckets`` equal bins over ``[0, num_train_timesteps)``).

    Sums stay on the device: :meth:`device_vector` gives ``[sum, count, nonfinite]`` per bucket
    for one step (3 x buckets values) to ride in the step's single transfer; :meth:`add`
    accumulates the fetched values on the host.

    With only a scalar loss, the batch loss is attributed to the bucket of every sample's
    timestep (each sample counts once, with the batch's loss): a practical curve when batches
    mix timesteps, exact when ``per_sample_loss`` is given.
    """

    def __init__(self, buckets: int, num_train_timesteps: int):
        self.buckets = buckets
        self.num_train_timesteps = max(1, int(num_train_timesteps))
        self.sum = [0.0] * buckets
        self.count = [0] * buckets
        self.nonfinite = [0] * buckets
        self._edges_on: dict[torch.device, torch.Tensor] = {}
        self._columns_on: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}

    def device_vector(
        self, timesteps: torch.Tensor, loss: torch.Tensor, per_sample_loss: torch.Tensor | None, device: torch.device
    ) -> torch.Tensor:
        t = timesteps.detach().reshape(-1)
        if t.dtype in (torch.int64, torch.int32):  # the usual: the same floor in integers, in one op
            # floor(t * buckets / N) >= k  <=>  t >= ceil(k * N / buckets) for an integer t: the number of
            # those edges at or below t is the bucket, clamped to [0, buckets) (a multiplication, a floor
            # division and a clamp before: two kernel launches more a step)
            edges = self._edges_on.get(device)
            if edges is None:
                edges = self._edges(device)
            index = torch.bucketize(t.to(device=device, dtype=torch.int64), edges, right=True)
        else:
            t = t.to(device=device, dtype=torch.float64)
            index = (t * self.buckets / self.num_train_timesteps).floor().clamp(0, self.buckets - 1).long()
        if per_sample_loss is not None:
            values = per_sample_loss.detach().reshape(-1).to(device=device, dtype=torch.float64)
            if values.numel() != t.numel():
                raise ValueError(f"per_sample_loss has {values.numel()} values for {t.numel()} timesteps.")
            finite = (values.abs() < math.inf).double()  # isfinite's answer in two ops (it takes four)
            # (the finite values, finite, not finite) per sample, added into their buckets in one op
            per_sample = torch.stack([values.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0), finite, 1.0 - finite])
        else:  # one loss for every sample: the column (loss, 1, 0), or (0, 0, 1) for a NaN/Inf, in four ops, not six
            value = loss.detach().to(device=device, dtype=torch.float64).reshape(1)
            columns = self._columns_on.get(device)
            if columns is None:
                columns = self._columns(device)
            column = torch.where(value.abs() < math.inf, torch.cat([value, columns[0]]), columns[1])
            per_sample = column.unsqueeze(1).expand(3, t.numel())
        out = torch.zeros(3, self.buckets, dtype=torch.float64, device=device)
        return out.index_add_(1, index, per_sample).reshape(-1)

    def _columns(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """A finite loss's column after the loss, ``(1, 0)``, and a non-finite one's, ``(0, 0, 1)`` (made once)."""
        columns = self._columns_on[device] = (
            to_device([1.0, 0.0], torch.float64, device),
            to_device([0.0, 0.0, 1.0], torch.float64, device),
        )
        return columns

    def _edges(self, device: torch.device) -> torch.Tensor:
        """The first integer timestep of each bucket after the first (int64 on ``device``, made once)."""
        edges = self._edges_on.get(device)
        if edges is None:
            n, b = self.num_train_timesteps, self.buckets
            firsts = [-(-k * n // b) for k in range(1, b)]  # ceil(k * n / b), in integers
            edges = self._edges_on[device] = to_device(firsts, torch.int64, device)
        return edges

    def add(self, row: list[float]) -> None:
        b = self.buckets
        for i in range(b):
            self.sum[i] += row[i]
            self.count[i] += int(row[b + i])
            self.nonfinite[i] += int(row[2 * b + i])

    def summary(self) -> list[dict]:
        width = self.num_train_timesteps / self.buckets
        return [
            {
                "bucket": i,
                "timesteps": [round(i * width), round((i + 1) * width)],
                "count": self.count[i],
                "mean_loss": self.sum[i] / self.count[i] if self.count[i] else None,
                "nonfinite": self.nonfinite[i],
            }
            for i in range(self.buckets)
        ]


class LossAccumulator:
    """The loss (and timestep-bucket sums) of the optimizer step in progress, added up over its
    micro-steps on the device: nothing reaches the host until the step's one transfer."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.loss_sum: torch.Tensor | None = None
        self.count = 0
        self.bucket_sum: torch.Tensor | None = None
        self.samples = 0
        self.input_nonfinite: torch.Tensor | None = None
        """Non-finite values in the ``inputs=`` batches of the step (None: none passed)."""
        self.input_counts: dict[str, torch.Tensor] = {}
        self.input_producers: dict[str, tuple] = {}
        """Inputs that a model outside the trained ones made (``CountedInputs.producers``)."""
        self.input_forwards: list = []
        """The trained models' calls of the step, kept for a replay (``CountedInputs.forwards``)."""

    def add(
        self,
        loss: torch.Tensor | float,
        device: torch.device,
        buckets: TimestepBuckets,
        timesteps: torch.Tensor | None = None,
        per_sample_loss: torch.Tensor | None = None,
        batch_size: int | None = None,
        inputs: Any = None,
    ) -> None:
        if loss is NO_LOSS:
            value = None
        elif isinstance(loss, torch.Tensor):
            detached = loss.detach()
            value = detached.to(device=device, dtype=torch.float64)
            if value.numel() != 1:
                value = value.reshape(-1).mean()
            elif value is detached:  # float64 on the device already: a copy, not the user's loss itself,
                value = value.reshape(()).clone()  # which they may change in place before the transfer
            else:  # a scalar loss (the usual one) is its own mean: a view of the conversion's copy, no op
                value = value.reshape(())
        else:
            value = torch.tensor(float(loss), dtype=torch.float64, device=device)
        if value is not None:
            self.loss_sum = value if self.loss_sum is None else self.loss_sum + value
            self.count += 1
        if timesteps is not None and value is not None:
            timesteps = torch.as_tensor(timesteps)
            vec = buckets.device_vector(timesteps, value, per_sample_loss, device)
            self.bucket_sum = vec if self.bucket_sum is None else self.bucket_sum + vec
            self.samples += timesteps.numel()
        elif per_sample_loss is not None:
            self.samples += per_sample_loss.numel()
        elif batch_size is not None:
            self.samples += int(batch_size)
        if inputs is not None:
            counts = nonfinite_counts(inputs, device)
            total = torch.stack(list(counts.values())).sum() if counts else torch.zeros((), device=device)
            total = total.double()
            self.input_nonfinite = total if self.input_nonfinite is None else self.input_nonfinite + total
            for name, count in counts.items():
                previous = self.input_counts.get(name)
                self.input_counts[name] = count if previous is None else previous + count
            if isinstance(inputs, CountedInputs):
                self.input_producers.update(inputs.producers)
                self.input_forwards += inputs.forwards

    def mean(self) -> torch.Tensor:
        """The step's mean loss (float64, on the device; one micro-step's own loss as it is)."""
        return self.loss_sum if self.count == 1 else self.loss_sum / self.count


TRAINED_ARGUMENT: tuple = ("", "", "a trained model's argument")
"""``CountedInputs.producers``' value for a path that is a trained model's argument (launch counts
its first forward under grad of each micro-step): a NaN seen first there may be a trained text
encoder's output, made by its non-finite weights; one seen first at a frozen model's argument,
counted only before any trained forward, never is."""


class CountedInputs(dict):
    """Inputs counted where they were seen (``diffusion-debug launch`` counts the batch, the trained
    model's arguments and the frozen models' outputs as the script makes them): path -> NaN/Inf
    count, a device scalar, in the order they were made. ``producers`` names the paths that are a
    frozen model's output from finite inputs, ``{path: (component, module[, weights])}``: when the
    first non-finite path is one of them, that model made the NaN (``nonfinite_input`` names it,
    and the weight that ``weights()`` reads, ``(name, count)``, when one holds NaN/Inf); a trained
    model's argument is :data:`TRAINED_ARGUMENT` there. ``forwards``: the trained models' calls
    that fed on them (``judges.forward_replay.KeptForward``), replayed when the loss is NaN/Inf."""

    def __init__(
        self, counts: dict[str, torch.Tensor], producers: dict[str, tuple] | None = None, forwards: list = ()
    ):
        super().__init__(counts)
        self.producers = dict(producers or {})
        self.forwards = list(forwards)


def nonfinite_counts(inputs: Any, device: torch.device, name: str = "inputs") -> dict[str, torch.Tensor]:
    """NaN/Inf count (a device scalar: no sync) of every floating-point tensor in ``inputs``, a
    tensor or a nested value of them (:func:`stats.walk_tensors`), by path (``inputs["pixel_values"]``).
    Integer tensors (token ids) and other values are skipped. :class:`CountedInputs` are counted
    already: their counts, on ``device``.

    >>> counts = nonfinite_counts({"pixels": torch.tensor([1.0, float("nan")]), "ids": torch.tensor([1])}, "cpu")
    >>> {k: int(v) for k, v in counts.items()}
    {'inputs["pixels"]': 1}
    """
    if isinstance(inputs, CountedInputs):
        return {path: _on(count, torch.device(device)) for path, count in inputs.items()}
    out: dict[str, torch.Tensor] = {}
    for keys, tensor in walk_tensors(inputs):
        if tensor.is_floating_point() or tensor.is_complex():
            path = name + "".join(f"[{key!r}]".replace("'", '"') for key in keys)
            out[path] = (~torch.isfinite(tensor.detach())).sum().to(device)
    return out


def _on(count: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``count`` on ``device`` without blocking the host (a host count goes to a GPU through pinned memory)."""
    if count.device == device:
        return count
    if count.device.type == "cpu" and device.type == "cuda":
        return count.pin_memory().to(device, non_blocking=True)
    return count.to(device)


def num_train_timesteps(noise_scheduler: Any) -> int:
    """The scheduler's ``num_train_timesteps`` (config object or dict); 1000 when unknown."""
    config = getattr(noise_scheduler, "config", None)
    value = getattr(config, "num_train_timesteps", None) if config is not None else None
    if value is None and isinstance(config, dict):
        value = config.get("num_train_timesteps")
    return int(value) if value else 1000
