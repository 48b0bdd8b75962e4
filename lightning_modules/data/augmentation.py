"""The random tail of the training pipeline: MONAI's patch sampling and intensity augmentation,
draw for draw, without MONAI's per-call machinery when metadata tracking is off.

Training crops feed the network only, so they need no metadata (:class:`RandomPartWithoutMetadata`
turns MONAI's tracking off for the random tail). On the CPU profile, MONAI's general machinery then
costs more than the work itself: per transform call it dispatches through ``apply_transform`` and
checks pending lazy operations, per crop it builds a ``SpatialCrop`` and a translation affine, and
per patch centre it unravels one index through a torch or NumPy round trip; about 3.7 ms of a
batch of 4 crops of 32³ whose arithmetic takes well under 1 ms. Each class below is MONAI's own
transform with a plain-tensor path that:

- consumes the transform's ``RandomState`` in exactly MONAI's order and amounts (same seeds, same
  draws: a recipe trains the same model as with MONAI's classes, bit for bit);
- computes the same numbers with the same float32 operations (tests compare the outputs with
  MONAI's classes, tensor for tensor, over many draws);
- is taken only where that holds (metadata tracking off, eager execution, plain tensors, the
  settings this project uses); anything else runs MONAI's own code unchanged.

So the classes are drop-in: ``training_transforms`` lists them where MONAI's would stand, and a
``Compose`` seeds them as it would seed MONAI's. The cost left is the work itself, mostly
``RandGaussianNoise``'s float64 draw (kept: a different generator would change every model).
"""

from __future__ import annotations

from copy import deepcopy

import numpy as np
import torch
from monai.data import MetaTensor, get_track_meta, set_track_meta
from monai.transforms import (
    Compose,
    RandCropByLabelClassesd,
    RandGaussianNoised,
    RandomizableTrait,
    ReduceTrait,
    RandScaleIntensityd,
    RandShiftIntensityd,
    Transform,
)
from monai.utils import convert_to_tensor, fall_back_tuple


class RandCropByLabelClassesPlaind(RandCropByLabelClassesd):
    """MONAI's ``RandCropByLabelClassesd`` whose crops, when metadata tracking is off, are plain slices.

    The centres are MONAI's (``generate_label_classes_crop_centers``: the same ``choice`` of classes
    and ``randint`` per crop, from the same ``RandomState``; the same clamping into the valid range)
    computed with plain integer arithmetic, and so are the slices (its ``Crop.compute_slices``);
    what is skipped is building a ``SpatialCrop`` per crop and its check of pending lazy operations
    and translation affine, which a plain tensor does not carry. The output is identical to MONAI's,
    tensor for tensor (tested). With metadata tracking on, lazy execution or pending operations,
    MONAI's own ``__call__`` runs; without precomputed class indices, with a volume smaller than the
    patch or ``allow_smaller``, MONAI's own ``randomize`` chooses the centres (and a window that
    overhangs the volume is sliced as MONAI slices it).
    """

    def _valid_range(self, shape: tuple[int, ...], size: tuple[int, ...]) -> list[tuple[int, int]]:
        """``correct_crop_centers``' valid centres per axis, with its arithmetic (a uint16 upper
        bound, widened by one where the range would be empty), as (low, high) with high exclusive."""
        ranges = self.__dict__.setdefault("_ranges", {})
        key = (shape, size)
        if key not in ranges:
            start = np.floor_divide(size, 2)
            end = np.subtract(np.asarray(shape) + np.array(1), np.asarray(size) / np.array(2)).astype(np.uint16)
            ranges[key] = [(int(s), int(e) + 1 if s == e else int(e)) for s, e in zip(start, end)]
        return ranges[key]

    def _fast_centres(self, shape: tuple[int, ...], indices) -> list[tuple[int, ...]] | None:
        """MONAI's centres from MONAI's draws, or None where MONAI's own function must run."""
        cropper = self.cropper
        size = tuple(fall_back_tuple(cropper.spatial_size, default=shape))
        if cropper.allow_smaller or any(s < p for s, p in zip(shape, size)) or cropper.num_samples < 1:
            return None
        ratios = list([1] * len(indices) if cropper.ratios is None else cropper.ratios)
        if len(ratios) != len(indices) or any(not r >= 0 for r in ratios):
            return None  # MONAI raises its own error
        for i, array in enumerate(indices):
            if len(array) == 0 and ratios[i] != 0:
                if cropper.warn:
                    return None  # MONAI warns
                ratios[i] = 0
        if not 0 < sum(ratios) < float("inf"):
            return None  # NumPy's choice raises its own error
        bounds = self._valid_range(shape, size)
        R = cropper.R
        classes = _legacy_choice(R, ratios, cropper.num_samples)
        centres = []
        for k in classes:
            candidates = indices[k]
            if isinstance(candidates, torch.Tensor):
                candidates = candidates.numpy()
            flat = int(candidates[R.randint(len(candidates))])
            centre = []
            for extent, (low, high) in zip(reversed(shape), reversed(bounds)):  # unravel, C order
                flat, c = divmod(flat, extent)
                centre.append(min(max(c, low), high - 1))
            centres.append(tuple(reversed(centre)))
        return centres

    def __call__(self, data, lazy: bool | None = None):
        lazy_ = self.lazy if lazy is None else lazy
        if get_track_meta() or lazy_:
            return super().__call__(data, lazy=lazy)
        d = dict(data)
        label, indices, image = d.get(self.label_key), d.pop(self.indices_key, None), d.get(self.image_key)
        # Plain views of the volumes to crop (a MetaTensor's every attribute access dispatches
        # through its __torch_function__; a plain view's does not).
        plain = {}
        for key in self.key_iterator(d):
            value = d[key]
            if _pending(value):
                return super().__call__(data, lazy=lazy)
            plain[key] = value.as_tensor() if isinstance(value, MetaTensor) else convert_to_tensor(value)
        reference = label if label is not None else image
        reference_key = self.label_key if label is not None else self.image_key
        centres = None
        if indices is not None and reference is not None and not _pending(reference):
            view = plain.get(reference_key)  # already converted when it is cropped too
            if view is None:
                view = reference.as_tensor() if isinstance(reference, MetaTensor) else convert_to_tensor(reference)
            centres = self._fast_centres(tuple(view.shape[1:]), indices)
        if centres is None:
            self.randomize(label, indices, image)
            centres = [tuple(int(c) for c in centre) for centre in self.cropper.centers]
        else:
            self.cropper.centers = tuple(centres)
        crops: list[dict] = [dict(d) for _ in range(len(centres))]
        others = set(d).difference(self.keys)
        for crop in crops:  # as MONAI: every crop gets its own copy of the keys it does not crop
            for key in others:
                value = d[key]  # (deepcopy returns an immutable value itself)
                crop[key] = value if isinstance(value, _IMMUTABLE) else deepcopy(value)
        for key, volume in plain.items():
            size = fall_back_tuple(self.cropper.spatial_size, default=volume.shape[1:])
            for crop, centre in zip(crops, centres):
                crop[key] = _window(volume, centre, size)
        return crops


def _window(volume: torch.Tensor, centre, size) -> torch.Tensor:
    """``volume[:, Crop.compute_slices(roi_center=centre, roi_size=size)]``.

    ``compute_slices`` starts each axis at ``max(c - s // 2, 0)`` and ends ``s`` later. Where the
    window fits (always, for MONAI's clamped centres) the view is built in one ``as_strided`` call
    instead of slicing's four: the same view (storage, offset, strides, sizes). A window that
    overhangs is sliced, as MONAI slices it.
    """
    starts = [max(c - s // 2, 0) for c, s in zip(centre, size)]
    shape = volume.shape
    if any(a + s > shape[axis] for axis, (a, s) in enumerate(zip(starts, size), start=1)):
        return volume[(slice(None), *(slice(a, a + s) for a, s in zip(starts, size)))]
    strides = volume.stride()
    offset = volume.storage_offset() + sum(a * strides[axis] for axis, a in enumerate(starts, start=1))
    return volume.as_strided((shape[0], *size), strides, offset)


_IMMUTABLE = (str, int, float, bool, type(None))
_FLOAT32 = (np.float32, torch.float32, "float32")
_CDF: dict[tuple, np.ndarray] = {}


def _legacy_choice(R: np.random.RandomState, ratios: list, n: int) -> np.ndarray:
    """``R.choice(len(ratios), size=n, p=ratios / sum(ratios))``, value for value and draw for draw.

    NumPy's legacy ``RandomState`` stream is frozen (NEP 19), and its ``choice`` with ``p`` draws
    ``random_sample(n)`` and looks the draws up in the normalised cumulative sum; so does this,
    without ``choice``'s argument checks (about 30 us a call; the caller passes only finite,
    non-negative ratios with a positive sum, and leaves anything else to MONAI's path). Tested
    against ``choice`` itself.
    """
    key = tuple(ratios)
    cdf = _CDF.get(key)
    if cdf is None:
        cdf = (np.asarray(ratios, dtype=float) / np.sum(ratios)).cumsum()
        cdf /= cdf[-1]
        _CDF[key] = cdf
    return cdf.searchsorted(R.random_sample(n), side="right")


def _pending(value) -> bool:
    """A MetaTensor with pending lazy operations (its shape is not yet its data's)."""
    return isinstance(value, MetaTensor) and bool(value.pending_operations)


class _PlainIntensity:
    """The plain-tensor path shared by the intensity transforms below (mixed into MONAI's classes).

    Taken when metadata tracking is off, the transform's settings are ones the path reproduces and
    every key holds a plain float32 tensor; MONAI's ``__call__`` otherwise. As in MONAI, the wrapper
    draws ``rand() < prob`` first, and all keys share one draw of the inner transform.

    Each transform that mixes it in defines two methods:

    - ``_plain_settings(self) -> bool``: whether its settings are ones the plain path reproduces;
    - ``_apply(self, d, keys) -> None``: draw as the inner transform's ``randomize`` does and apply
      the draw to every key of ``d``, in place.
    """

    def __call__(self, data):
        keys = self.keys
        for key in keys:
            value = data.get(key)
            if type(value) is not torch.Tensor or value.dtype is not torch.float32:
                return super().__call__(data)
        if get_track_meta() or not self._plain_settings():
            return super().__call__(data)
        d = dict(data)
        self.randomize(None)
        if self._do_transform:
            self._apply(d, keys)
        return d


class RandScaleIntensityPlaind(_PlainIntensity, RandScaleIntensityd):
    """MONAI's ``RandScaleIntensityd``; on plain float32 tensors ``x * (1 + factor)`` directly.

    Draws as MONAI: the wrapper's ``rand() < prob``, then (when it applies) the inner transform's
    ``rand()`` (its probability is 1) and ``uniform(factors)``.
    """

    def _plain_settings(self) -> bool:
        return not self.scaler.channel_wise and self.scaler.dtype in _FLOAT32

    def _apply(self, d: dict, keys) -> None:
        self.scaler.randomize(d[keys[0]])
        for key in keys:
            d[key] = d[key] * (1 + self.scaler.factor)


class RandShiftIntensityPlaind(_PlainIntensity, RandShiftIntensityd):
    """MONAI's ``RandShiftIntensityd``; on plain float32 tensors ``x + offset`` directly.

    Draws as MONAI: the wrapper's ``rand() < prob``, then the inner ``rand()`` and ``uniform(offsets)``.
    Only without ``factor_key`` metadata (MONAI would scale the offset by a value from the metadata).
    """

    def _plain_settings(self) -> bool:
        return not self.shifter.channel_wise and all(f is None for f in self.factor_key)

    def _apply(self, d: dict, keys) -> None:
        self.shifter.randomize(d[keys[0]])
        for key in keys:
            d[key] = d[key] + self.shifter._offset


class RandGaussianNoisePlaind(_PlainIntensity, RandGaussianNoised):
    """MONAI's ``RandGaussianNoised``; on plain float32 tensors the noise is added directly.

    The noise is MONAI's (the inner transform's ``randomize``: ``rand()``, ``uniform(0, std)``, then
    ``normal`` in float64 from NumPy's legacy generator, cast to float32), so are its draws.
    """

    def _plain_settings(self) -> bool:
        return self.rand_gaussian_noise.dtype in _FLOAT32

    def _apply(self, d: dict, keys) -> None:
        self.rand_gaussian_noise.randomize(d[keys[0]])
        noise = torch.as_tensor(self.rand_gaussian_noise.noise)
        for key in keys:
            d[key] = d[key] + noise


class RandomPartWithoutMetadata(Compose):
    """A Compose that runs its transforms from the first random one on with metadata tracking off.

    The deterministic head (loading, orientation, spacing, windowing) needs each volume's affine
    and keeps it. The random tail (patch crops, intensity augmentation) only feeds training, which
    needs plain tensors: with MONAI's metadata tracking on, every crop copies a MetaTensor's
    metadata and collation stacks it, most of a CPU-profile batch (15 -> 6 ms per batch of 4
    crops of 32³, same crops). MONAI's switch is process-global (``set_track_meta``); it is set
    for the tail and restored after, also on error. Evaluation transforms have no random tail.

    The tail calls its transforms directly (a list of crops is mapped item by item, as MONAI's
    ``map_items``), without ``apply_transform``'s per-call checks of pending lazy operations, which
    plain tensors cannot have; an error is re-raised naming the transform, as MONAI does.
    """

    def get_index_of_first(self, predicate):
        """MONAI's ``get_index_of_first``, remembered per predicate and transform tuple.

        ``CacheDataset`` asks it for every item, with a predicate of its own, to find where the
        cached head ends (about 40 us each on the CPU profile). Only a predicate on the transforms'
        types is remembered (no closure; its names are ``isinstance`` and classes), keyed by its
        code (a lambda written once always has the same code); any other is asked every time.
        """
        code = getattr(predicate, "__code__", None)
        names = getattr(predicate, "__globals__", {})
        if code is None or predicate.__closure__ is not None or not all(
            name == "isinstance" or isinstance(names.get(name), type) for name in code.co_names
        ):
            return super().get_index_of_first(predicate)
        cache = self.__dict__.get("_first_index")
        if cache is None or cache[0] is not self.transforms:
            cache = self._first_index = (self.transforms, {})
        if code not in cache[1]:
            cache[1][code] = super().get_index_of_first(predicate)
        return cache[1][code]

    def _first_random(self) -> int | None:
        # CacheDataset's own rule for where the cached head ends, so the two agree.
        return self.get_index_of_first(lambda t: isinstance(t, RandomizableTrait) or not isinstance(t, Transform))

    def _direct(self, data, start: int, stop: int):
        for transform in self.transforms[start:stop]:
            try:
                if isinstance(data, (list, tuple)):
                    data = [transform(item) for item in data]
                else:
                    data = transform(data)
            except Exception as error:
                raise RuntimeError(f"applying transform {transform}") from error
        return data

    def __call__(self, input_, start=0, end=None, threading=False, lazy=None):
        first = self._first_random()
        stop = len(self.transforms) if end is None else end
        if first is None or first >= stop:
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        if start < first:
            input_ = super().__call__(input_, start=start, end=first, threading=threading, lazy=lazy)
            start = first
        direct = (
            not lazy and not self.lazy and self.map_items is True and not self.unpack_items and not self.log_stats
            and self.overrides is None
            and not any(isinstance(t, (Compose, ReduceTrait)) for t in self.transforms[start:stop])
        )
        tracking = get_track_meta()
        set_track_meta(False)
        try:
            if direct:
                return self._direct(input_, start, stop)
            return super().__call__(input_, start=start, end=end, threading=threading, lazy=lazy)
        finally:
            set_track_meta(tracking)
